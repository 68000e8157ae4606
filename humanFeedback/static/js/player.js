// The two clips of a pair, played together at the chosen speed. Two pairs are double-buffered: the hidden one loads
// the next pair while the person watches this one, so answering shows the next pair at once.
import { $ } from "./state.js";

export function pairs() { return [$("#pair-a"), $("#pair-b")]; }
export function activePair() { return pairs().find((p) => p.classList.contains("active")); }
export function hiddenPair() { return pairs().find((p) => !p.classList.contains("active")); }

export function speed() { return Number($("#speed").value) || 1; }

export function applySpeed() {
  for (const v of document.querySelectorAll("video.clip")) {
    v.defaultPlaybackRate = speed();
    v.playbackRate = speed();
  }
}

function showClipSharp(v) {   // never wider than the clip itself: an enlarged clip is a blurred one
  if (v.videoWidth) v.style.maxWidth = `${v.videoWidth}px`;
}
for (const v of document.querySelectorAll("video.clip")) v.addEventListener("loadedmetadata", () => showClipSharp(v));

export function loadPair(pairEl, q) {
  if (pairEl.dataset.queryId === String(q.query_id)) return;
  pairEl.dataset.queryId = String(q.query_id);
  const [left, right] = [pairEl.querySelector("video.left"), pairEl.querySelector("video.right")];
  left.src = q.left_url;
  right.src = q.right_url;
  for (const v of [left, right]) {
    v.defaultPlaybackRate = speed();
    v.playbackRate = speed();
    v.load();
  }
}

export function startTogether(pairEl) {
  const videos = [...pairEl.querySelectorAll("video")];
  const ready = videos.map((v) => v.readyState >= 2 ? Promise.resolve() :
    new Promise((res) => v.addEventListener("loadeddata", res, { once: true })));
  const id = pairEl.dataset.queryId;
  Promise.all(ready).then(() => {
    if (pairEl.dataset.queryId !== id || !pairEl.classList.contains("active")) return;
    for (const v of videos) {
      v.playbackRate = speed();
      v.currentTime = 0;
      const p = v.play();
      if (p && p.catch) p.catch(() => {});
    }
  });
}

// Puts q on screen: in the hidden pair when that one already holds it (prefetched), then swaps the two.
export function showPair(q) {
  let target = activePair();
  const other = hiddenPair();
  if (other.dataset.queryId === String(q.query_id)) target = other;   // the prefetched pair is ready: swap
  loadPair(target, q);
  for (const p of pairs()) {
    const on = p === target;
    p.classList.toggle("active", on);
    p.classList.toggle("hidden", !on);
    p.setAttribute("aria-hidden", on ? "false" : "true");
    if (!on) for (const v of p.querySelectorAll("video")) v.pause();
  }
  $("#pairs").dataset.queryId = String(q.query_id);
  startTogether(target);
}

export function pauseAll() {
  for (const v of document.querySelectorAll("video.clip")) v.pause();
}

export function forgetPairs() {
  for (const p of pairs()) p.dataset.queryId = "";
}
