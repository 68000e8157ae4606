// The answer components, one per kind of query the server gives (its "kind"): each shows a query's clips, turns the
// person's keys and clicks into an answer ({choice}, {ranking} or {ratings}: the body POST /api/queries/<id>/label takes) and
// says what an undone answer was. main.js asks the component of the query on screen; another kind of query adds its
// component here and its elements to index.html.
import { showPair, speed, startTogether } from "./player.js";
import { $, CHOICE_NAMES, KEYS, UNDO_KEY } from "./state.js";

// A pair: two clips side by side (player.js double-buffers them), answered with a choice button or an arrow key.
const pair = {
  noun: "pair",
  view: "#pairs",
  controls: "#choices",
  show(q) { showPair(q); },
  key(ev) { return KEYS[ev.key] ? { choice: KEYS[ev.key] } : null; },
  describe(answer) { return `“${CHOICE_NAMES[answer.choice]}”`; },
  markEarlier(answer) {
    const b = document.querySelector(`#choices button.choice[data-choice="${answer.choice}"]`);
    if (b) b.classList.add("earlier");
  },
};

// A ranking of k clips: the person presses the clips best first (keys 1..k, or a click), or drags them into the
// order list and within it; Backspace takes back the last clip placed; Enter (or the button) submits a complete order.
const ORDINALS = ["1st", "2nd", "3rd", "4th", "5th", "6th"];
let order = [];   // clip positions placed so far, best first
let clips = 0;    // clips of the ranking on screen

function renderOrder() {
  for (const fig of document.querySelectorAll("#rank-clips figure")) {
    const place = order.indexOf(Number(fig.dataset.clip));
    fig.querySelector(".place").textContent = place < 0 ? "" : ORDINALS[place];
    fig.classList.toggle("placed", place >= 0);
  }
  $("#rank-order").replaceChildren(...order.map((clip, place) => {
    const li = document.createElement("li");
    li.textContent = `Clip ${clip + 1}`;
    li.dataset.clip = String(clip);
    li.draggable = true;
    li.title = `${ORDINALS[place]}: drag to move`;
    return li;
  }));
  $("#rank-hint").textContent = order.length < clips
    ? `Press the clips best first (${order.length} of ${clips} placed)`
    : "Order complete: Enter submits it";
  $("#rank-submit").disabled = order.length < clips;
}

function place(clip, before = order.length) {   // clip to the order, before the one at `before` (at the end by default)
  const at = order.indexOf(clip);
  if (at >= 0) { order.splice(at, 1); if (at < before) before -= 1; }
  order.splice(before, 0, clip);
  renderOrder();
}

function toggle(clip) {   // a click or a key: place an unplaced clip next, take a placed one out
  if (order.includes(clip)) { order = order.filter((c) => c !== clip); renderOrder(); } else place(clip);
}

function clipFigure(url, clip) {
  const fig = document.createElement("figure");
  fig.dataset.clip = String(clip);
  fig.draggable = true;
  const v = document.createElement("video");
  v.className = "clip";
  Object.assign(v, { muted: true, autoplay: true, loop: true, playsInline: true, preload: "auto", src: url });
  v.defaultPlaybackRate = v.playbackRate = speed();
  const caption = document.createElement("figcaption");
  const key = document.createElement("kbd");
  key.textContent = String(clip + 1);
  const placeBadge = document.createElement("strong");
  placeBadge.className = "place";
  caption.append(key, ` Clip ${clip + 1} `, placeBadge);
  fig.append(v, caption);
  fig.addEventListener("click", () => toggle(clip));
  return fig;
}

let dragged = null;   // the clip being dragged (from a clip or from the order list)
document.addEventListener("dragstart", (ev) => {
  const source = ev.target.closest && ev.target.closest("#rank-clips figure, #rank-order li");
  if (!source) return;
  dragged = Number(source.dataset.clip);
  ev.dataTransfer.setData("text/plain", String(dragged));
});
for (const sel of ["#rank-order", "#rank-drop"]) {
  const zone = $(sel);
  zone.addEventListener("dragover", (ev) => { if (dragged !== null) ev.preventDefault(); });
  zone.addEventListener("drop", (ev) => {
    ev.preventDefault();
    if (dragged === null) return;
    const target = ev.target.closest("li");
    place(dragged, target ? order.indexOf(Number(target.dataset.clip)) : order.length);
    dragged = null;
  });
}

const ranking = {
  noun: "ranking",
  view: "#ranking",
  controls: "#rank-controls",
  show(q) {
    const box = $("#ranking");
    order = [];   // also for a ranking back from an undo: the person orders it again
    clips = q.clip_urls.length;
    if (box.dataset.queryId !== String(q.query_id)) {
      $("#rank-clips").replaceChildren(...q.clip_urls.map(clipFigure));
      box.dataset.queryId = String(q.query_id);
    }
    renderOrder();
    startTogether(box);
  },
  key(ev) {
    const clip = Number(ev.key) - 1;
    if (Number.isInteger(clip) && clip >= 0 && clip < clips) { toggle(clip); return true; }
    if (ev.key === UNDO_KEY && order.length) { order.pop(); renderOrder(); return true; }
    if (ev.key === "Enter") return order.length === clips ? this.submit() : true;
    if (ev.key === "ArrowDown") return { choice: "skip" };
    return null;
  },
  submit() { return { ranking: [...order] }; },
  describe(answer) {
    if (!answer.ranking) return `“${CHOICE_NAMES[answer.choice]}”`;
    return `the order ${answer.ranking.map((clip) => `Clip ${clip + 1}`).join(", ")}`;
  },
  markEarlier(answer) { $("#rank-hint").textContent = `Your earlier answer: ${this.describe(answer)}. Press the clips best first.`; },
};

// Ratings of k clips on the query's scale (1 worst .. n best): a click on a clip's point, or keys: a digit rates the
// clip outlined (the first one not yet rated; 0 is 10), Backspace takes back the last rating given, Enter (or the
// button) submits once every clip is rated.
let ratings = [];     // each clip's rating so far (null: not yet)
let ratedOrder = [];  // clips in the order they were rated, for Backspace
let scale = 0;        // points of the scale on screen

function renderRatings() {
  const next = ratings.indexOf(null);
  for (const fig of document.querySelectorAll("#rate-clips figure")) {
    const clip = Number(fig.dataset.clip);
    fig.classList.toggle("current", clip === next);
    for (const b of fig.querySelectorAll("button.point")) b.classList.toggle("chosen", Number(b.dataset.rating) === ratings[clip]);
  }
  const left = ratings.filter((r) => r === null).length;
  $("#rate-hint").textContent = left
    ? `Rate each clip from 1 (worst) to ${scale} (best): ${ratings.length - left} of ${ratings.length} rated`
    : "Every clip rated: Enter submits";
  $("#rate-submit").disabled = left > 0;
}

function setRating(clip, rating) {
  ratings[clip] = rating;
  ratedOrder = [...ratedOrder.filter((c) => c !== clip), clip];
  renderRatings();
}

function ratingFigure(url, clip) {
  const fig = document.createElement("figure");
  fig.dataset.clip = String(clip);
  const v = document.createElement("video");
  v.className = "clip";
  Object.assign(v, { muted: true, autoplay: true, loop: true, playsInline: true, preload: "auto", src: url });
  v.defaultPlaybackRate = v.playbackRate = speed();
  const caption = document.createElement("figcaption");
  caption.append(`Clip ${clip + 1} `);
  const points = document.createElement("span");
  points.className = "points";
  for (let rating = 1; rating <= scale; rating++) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "point";
    b.dataset.rating = String(rating);
    b.textContent = String(rating);
    b.title = `Rate clip ${clip + 1}: ${rating} of ${scale}`;
    b.addEventListener("click", () => setRating(clip, rating));
    points.append(b);
  }
  caption.append(points);
  fig.append(v, caption);
  return fig;
}

const rating = {
  noun: "rating",
  view: "#rating",
  controls: "#rate-controls",
  show(q) {
    const box = $("#rating");
    scale = q.rating_scale;
    ratings = q.clip_urls.map(() => null);   // also for ratings back from an undo: the person rates again
    ratedOrder = [];
    if (box.dataset.queryId !== String(q.query_id)) {
      $("#rate-clips").replaceChildren(...q.clip_urls.map(ratingFigure));
      box.dataset.queryId = String(q.query_id);
    }
    renderRatings();
    startTogether(box);
  },
  key(ev) {
    const digit = ev.key === "0" ? 10 : Number(ev.key);
    const next = ratings.indexOf(null);
    if (/^[0-9]$/.test(ev.key)) { if (digit >= 1 && digit <= scale && next >= 0) setRating(next, digit); return true; }
    if (ev.key === UNDO_KEY && ratedOrder.length) { ratings[ratedOrder.pop()] = null; renderRatings(); return true; }
    if (ev.key === "Enter") return next < 0 ? this.submit() : true;
    if (ev.key === "ArrowDown") return { choice: "skip" };
    return null;
  },
  submit() { return { ratings: [...ratings] }; },
  describe(answer) {
    if (!answer.ratings) return `“${CHOICE_NAMES[answer.choice]}”`;
    return `the ratings ${answer.ratings.map((r, clip) => `Clip ${clip + 1}: ${r}`).join(", ")}`;
  },
  markEarlier(answer) { $("#rate-hint").textContent = `Your earlier answer: ${this.describe(answer)}. Rate each clip again.`; },
};

export const COMPONENTS = { pair, ranking, rating };

// The component of query q (a server from before rankings sends no kind: its queries are pairs).
export function componentOf(q) { return COMPONENTS[(q && q.kind) || "pair"]; }

// "Pair", "Ranking" or "Rating": the kind of query q is, as a line of the page starts with it.
export function nounOf(q) { const n = componentOf(q).noun; return n[0].toUpperCase() + n.slice(1); }

// Shows q with its component, and hides every other component's view and controls.
export function showQuery(q) {
  const shown = componentOf(q);
  for (const c of Object.values(COMPONENTS)) {
    $(c.view).classList.toggle("hidden", c !== shown);
    $(c.controls).classList.toggle("hidden", c !== shown);
    if (c !== shown) for (const v of $(c.view).querySelectorAll("video")) v.pause();
  }
  shown.show(q);
}

export function hideQueries() {
  for (const c of Object.values(COMPONENTS)) {
    $(c.view).classList.add("hidden");
    $(c.view).dataset.queryId = "";
  }
}
