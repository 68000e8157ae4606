// The labelling loop: lease a pair, show it, keep the answer in this browser, send it until the server has it,
// prefetch the next pair meanwhile; undo; the run panel, kept current; the two views, the name form, the other-tab
// warning and invitations. Loaded by index.html as an ES module.
import {
  getConfig, getInvitations, getLatestEvaluation, getNext, getRunState, getRuns, postInvitation, postLabel, postRevoke, postUndo,
} from "./api.js";
import { componentOf, nounOf, showQuery } from "./answers.js";
import { activePair, applySpeed, forgetPairs, hiddenPair, loadPair, pauseAll, startTogether } from "./player.js";
import {
  $, NAME_KEY, RUN_KEY, SPEED_KEY, UNDO_KEY, noteProgress, noteRunCounts, outbox, saveOutbox, state, unsentIds,
} from "./state.js";
import {
  loadRewards, notice, renderEvaluations, renderInstructions, renderLatestEvaluation, renderOtherTabs, renderOutbox,
  renderProgress, renderRunState, runLabel, setChoicesEnabled, showWaiting,
} from "./views.js";

function show(q) {
  for (const b of document.querySelectorAll("button.choice.earlier")) b.classList.remove("earlier");
  state.current = q;
  showQuery(q);   // with the component of its kind (answers.js): a pair, or clips to rank
  $("#waiting").classList.add("hidden");
  setChoicesEnabled(true);
  noteProgress(q.run_id, q.session, q.progress);
  renderInstructions(q);
  renderProgress();
  refreshRunPanel();
}

// ------------------------------------------------------------------ the run panel: refreshed every 3 s

const RUN_PANEL_SECONDS = 3;

function panelRun() {   // the run of the pair on screen, else the one picked, else the one last answered
  if (state.current) return String(state.current.run_id);
  if (state.run) return state.run;
  if (state.lastSession) return String(state.lastSession.run);
  const news = state.training || [];
  return news.length ? String(news[0].run_id) : null;
}

let panelTimer = null;
async function refreshRunPanel() {
  clearTimeout(panelTimer);
  panelTimer = setTimeout(refreshRunPanel, RUN_PANEL_SECONDS * 1000);
  const runId = panelRun();
  if (!runId || !state.annotator || location.hash === "#rewards") return;
  try {
    const [info, latest] = await Promise.all([getRunState(runId), getLatestEvaluation(runId)]);
    if (panelRun() !== runId) return;   // another run is on screen meanwhile
    state.runState = info;
    noteRunCounts(Number(runId), info);
    renderRunState(info);
    renderLatestEvaluation(latest.evaluations[0] || null);
    renderProgress();
  } catch (e) { /* the pairs' own requests say when the server is away */ }
}

// ------------------------------------------------------------------ runs

async function loadRunPicker() {
  const select = $("#run-pick");
  try {
    const { runs } = await getRuns();
    const keep = state.run;
    select.replaceChildren(new Option("All runs", ""), ...runs.map((r) => new Option(runLabel(r), String(r.run_id))));
    if (keep && !runs.some((r) => String(r.run_id) === keep)) select.append(new Option(`run ${keep}`, keep));
    select.value = keep;
  } catch (e) { /* the picker keeps what it had; the pairs' own errors are shown */ }
}

function pickRun(value) {
  state.run = value;
  localStorage.setItem(RUN_KEY, value);
  $("#run-pick").value = value;   // also when called from code: no later loadRunPicker is sure to repaint it
  // pairs of another run already leased to us expire on the server after the lease
  state.current = null;
  state.prefetched = null;
  state.lastSession = null;
  forgetPairs();
  $("#progress").textContent = "";
  loadNext();
}

// ------------------------------------------------------------------ fetching queries

function isFresh(q) {
  const lease = (state.config && state.config.lease_seconds) || 60;
  return Date.now() - q.fetchedAt < lease * 800;   // 80 % of the lease, in ms
}

async function fetchNext(exclude) {
  const q = await getNext({ annotator: state.annotator, runId: state.run, exclude: [...new Set([...exclude, ...unsentIds()])] });
  if (q.waiting) { state.training = q.training; return null; }
  q.fetchedAt = Date.now();
  return q;
}

async function loadNext() {
  clearTimeout(state.pollTimer);
  if (!state.annotator || location.hash === "#rewards") return;
  if (state.prefetching) await state.prefetching.catch(() => {});
  const pre = state.prefetched;
  state.prefetched = null;
  if (pre && isFresh(pre) && !(String(pre.query_id) in outbox()) && (!state.run || String(pre.run_id) === state.run)) {
    show(pre);
    prefetch();
    return;
  }
  if (state.loading) return;
  state.loading = true;
  try {
    const q = await fetchNext([]);
    if (state.current) return;   // an undo put a pair on screen meanwhile; q stays leased to us
    if (q && (!state.run || String(q.run_id) === state.run)) {
      show(q);
      prefetch();
    } else {
      showWaiting(state.training);
      loadRunPicker();
      state.pollTimer = setTimeout(loadNext, 2000);
    }
  } catch (e) {
    if (e.status === 429) {   // this person holds the most pairs one may (other tabs): ask again when one is answered
      state.pollTimer = setTimeout(loadNext, 2000);
      return;
    }
    if (e.status === 404 && state.run) {   // the run remembered in this browser is not on this server: show all runs
      notice(`Run ${state.run} is not on this server; showing all runs.`);
      setTimeout(() => pickRun(""), 0);   // after this call's finally
      return;
    }
    if (e.status === undefined || e.status >= 500) notice("The server does not answer; trying again every 2 s…", true);
    else notice(e.message, true);
    state.pollTimer = setTimeout(loadNext, 2000);
  } finally {
    state.loading = false;
  }
}

function prefetch() {
  if (!state.current) return;
  const exclude = [state.current.query_id];
  const p = fetchNext(exclude).then((q) => {
    if (q && !(state.current && q.query_id === state.current.query_id)) {
      state.prefetched = q;
      if (componentOf(q).noun === "pair") loadPair(hiddenPair(), q);   // a pair loads behind the one on screen
    }
  }).catch(() => {}).finally(() => { if (state.prefetching === p) state.prefetching = null; });
  state.prefetching = p;
}

// ------------------------------------------------------------------ answering

// `given`: the answer of the query on screen, {choice}, {ranking} or {ratings} (answers.js)
function answer(given) {
  const q = state.current;
  if (!q || !state.config || !given || (given.choice !== undefined && !state.config.choices.includes(given.choice))) return;
  state.current = null;
  setChoicesEnabled(false);
  const box = outbox();   // kept in this browser first: nothing given is lost if the server is away
  box[q.query_id] = {
    choice: given.choice, ranking: given.ranking, ratings: given.ratings, annotator: state.annotator, run_id: q.run_id, session: q.session,
  };
  saveOutbox(box);
  state.lastSession = { run: q.run_id, session: q.session, noun: componentOf(q).noun };
  const done = sendLabel(q.query_id);
  state.history.push({ query: q, done });
  $("#undo").disabled = !state.config.allow_editing;
  notice("");
  renderOutbox();
  loadNext();
}

// Sends one kept answer until the server answers; resolves to the server's reply, or null when it refused the
// answer (someone else labelled the pair meanwhile, ...). A repeated send is harmless: the server stores an
// answer it already has once (200, same label).
const sending = new Map();   // query id -> the promise of its send: one sender per kept answer in this tab
function sendLabel(queryId) {
  const id = String(queryId);
  if (!sending.has(id)) sending.set(id, sendUntilAnswered(id).finally(() => sending.delete(id)));
  return sending.get(id);
}

async function sendUntilAnswered(queryId) {
  for (let attempt = 0; ; attempt++) {
    const a = outbox()[queryId];
    if (!a) return null;   // sent by another tab, or dropped
    try {
      const body = a.ranking ? { ranking: a.ranking } : a.ratings ? { ratings: a.ratings } : { choice: a.choice };
      const res = await postLabel(queryId, body, a.annotator);
      const box = outbox(); delete box[queryId]; saveOutbox(box);
      noteProgress(a.run_id, a.session, res.progress);
      if (state.offlineSince !== null && Object.keys(box).length === 0) {
        state.offlineSince = null;
        notice("The server is back: every kept answer is saved.");
      }
      renderProgress();
      renderOutbox();
      return res;
    } catch (e) {
      if (e.status === undefined || e.status >= 500) {   // server away or busy: keep it, try again later
        if (state.offlineSince === null) state.offlineSince = Date.now();
        renderOutbox();
        await new Promise((r) => setTimeout(r, Math.min(15000, 1000 * 2 ** Math.min(attempt, 4))));
        continue;
      }
      if (e.status === 409 && e.message.includes("shown to another annotator")) {
        // our lease ran out during the outage and someone else has the pair on screen: if they answer it, the
        // server refuses ours (dropped below, next time); if their lease ends first, ours is stored
        await new Promise((r) => setTimeout(r, 10000));
        continue;
      }
      const box = outbox(); delete box[queryId]; saveOutbox(box);
      notice(`Your answer to #${queryId} was not saved: ${e.message}`, true);
      renderProgress();
      renderOutbox();
      return null;
    }
  }
}

function sendKept() {   // answers kept by an earlier visit of this page (or another tab) that the server never confirmed
  for (const id of unsentIds()) sendLabel(id);
}

async function undoLast() {
  const last = state.history.pop();
  $("#undo").disabled = state.history.length === 0;
  if (!last) return;
  if (String(last.query.query_id) in outbox() && state.offlineSince !== null) {
    state.history.push(last);
    $("#undo").disabled = false;
    notice(`${nounOf(last.query)} #${last.query.query_id} is not sent yet; it can be undone once the server has it.`);
    return;
  }
  const saved = await last.done;
  if (!saved) { notice(`${nounOf(last.query)} #${last.query.query_id} had not been saved, nothing to undo.`); return; }
  try {
    // the undone pair takes the place of the next one (already leased to this browser): the server frees that one
    const release = state.prefetched ? [state.prefetched.query_id] : [];
    const res = await postUndo(last.query.query_id, state.annotator, release);
    if (state.prefetched && release.includes(state.prefetched.query_id)) state.prefetched = null;
    const q = res.query;
    q.fetchedAt = Date.now();
    if (state.current) {            // the query on screen becomes the next one again
      state.current.fetchedAt = Date.now();
      state.prefetched = state.current;
      if (componentOf(state.current).noun === "pair") loadPair(hiddenPair(), state.current);
    }
    clearTimeout(state.pollTimer);
    show(q);
    const component = componentOf(q);
    const undone = { choice: res.undone_choice, ranking: res.undone_ranking, ratings: res.undone_ratings };
    component.markEarlier(undone);
    const counts = {
      yes: "choose again: the agent learns from your new answer",
      "on resume": "choose again: the run has stopped, and learns from your new answer when it is resumed",
      no: "the run has finished: a new answer is kept here, but this run will not learn from it",
    }[res.learned];
    notice(`Undone: ${component.noun} #${q.query_id} is back. Your earlier answer was ${component.describe(undone)}; ${counts}.`);
  } catch (e) {
    notice(e.message, true);
  }
}

// ------------------------------------------------------------------ views, name, wiring

// The reward view's newest check, reordered: its clips as a query on the compare view, answered with the component of
// its kind (a ranking, or a pair of two clips); the query that was on screen comes next again.
function reorderCheck() {
  const q = state.reorder;
  if (!q) return;
  q.fetchedAt = Date.now();
  if (state.current && state.current.query_id !== q.query_id) {
    state.current.fetchedAt = Date.now();
    state.prefetched = state.current;
    if (componentOf(state.current).noun === "pair") loadPair(hiddenPair(), state.current);
  }
  clearTimeout(state.pollTimer);
  show(q);
  location.hash = "";
}

function route() {
  const rewards = location.hash === "#rewards";
  $("#tab-rewards").classList.toggle("active", rewards);
  $("#tab-compare").classList.toggle("active", !rewards);
  $("#rewards-view").classList.toggle("hidden", !rewards);
  const needName = !rewards && !state.annotator;
  $("#name-form").classList.toggle("hidden", !needName);
  $("#compare-view").classList.toggle("hidden", rewards || needName);
  $("#who").classList.toggle("hidden", !state.annotator);
  $("#who-name").textContent = state.annotator;
  renderOtherTabs();
  if (rewards) {
    clearTimeout(state.pollTimer);
    pauseAll();
    loadRewards();
  } else if (needName) {
    $("#annotator-input").focus();
  } else if (state.current) {
    startTogether(activePair());
  } else {
    loadRunPicker();
    sendKept();
    loadNext();
  }
  if (!rewards && !needName) refreshRunPanel();
}

function applyConfig(cfg) {
  state.config = cfg;
  $("#invite").classList.toggle("hidden", cfg.role !== "trainer");   // an invitee labels, and invites nobody
  for (const b of document.querySelectorAll("button.choice")) {
    b.classList.toggle("hidden", !cfg.choices.includes(b.dataset.choice));
  }
  $("#undo").classList.toggle("hidden", !cfg.allow_editing);
  const select = $("#speed");
  const def = String(cfg.playback_speed);
  if (![...select.options].some((o) => Number(o.value) === cfg.playback_speed)) {
    const o = document.createElement("option");
    o.value = def;
    o.textContent = `${cfg.playback_speed}×`;
    select.append(o);
  }
  const saved = localStorage.getItem(SPEED_KEY);
  select.value = saved && [...select.options].some((o) => o.value === saved) ? saved : def;
  if (!select.value) select.value = "1";
}

document.addEventListener("keydown", (ev) => {
  if (ev.repeat || ev.altKey || ev.ctrlKey || ev.metaKey) return;
  const tag = (ev.target && ev.target.tagName) || "";
  if (["INPUT", "SELECT", "TEXTAREA"].includes(tag)) return;
  if (location.hash === "#rewards" || $("#compare-view").classList.contains("hidden")) return;
  const given = state.current ? componentOf(state.current).key(ev) : null;   // true: the component took the key
  if (given) {
    ev.preventDefault();
    if (given !== true) answer(given);
    return;
  }
  if (ev.key === UNDO_KEY) {
    ev.preventDefault();
    if (!$("#undo").disabled && !$("#undo").classList.contains("hidden")) undoLast();
  }
});

for (const b of document.querySelectorAll("button.choice")) {
  b.addEventListener("click", () => answer({ choice: b.dataset.choice }));
}
for (const sel of ["#rank-submit", "#rate-submit"]) {
  $(sel).addEventListener("click", () => { if (state.current) answer(componentOf(state.current).submit()); });
}
$("#undo").addEventListener("click", undoLast);
$("#reorder-check").addEventListener("click", reorderCheck);
$("#speed").addEventListener("change", () => {
  localStorage.setItem(SPEED_KEY, $("#speed").value);
  applySpeed();
  if (state.current) renderInstructions(state.current);
});
$("#run-pick").addEventListener("change", () => pickRun($("#run-pick").value));
$("#run-select").addEventListener("change", () => renderEvaluations($("#run-select").value).catch((e) => notice(e.message, true)));
$("#name-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const name = $("#annotator-input").value.trim();
  if (!name) return;
  state.annotator = name;
  localStorage.setItem(NAME_KEY, name);
  route();
});
$("#change-name").addEventListener("click", () => {
  $("#annotator-input").value = state.annotator;
  state.annotator = "";
  localStorage.removeItem(NAME_KEY);
  state.current = null;
  state.prefetched = null;
  state.history = [];
  $("#undo").disabled = true;
  forgetPairs();
  route();
});
window.addEventListener("hashchange", route);
// Invitations (the trainer's browser only): a one-time login link for someone who may label and nothing else, and the
// list of every invitation, each revocable (its link dies and the browser it let in is logged out).
async function renderInvitations() {
  const { invitations } = await getInvitations();
  const rows = invitations.map((inv) => {
    const row = document.createElement("tr");
    row.dataset.invitation = String(inv.invitation_id);
    for (const text of [`#${inv.invitation_id}`, inv.name || "—", inv.role, inv.state]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.append(cell);
    }
    const cell = document.createElement("td");
    if (inv.state === "waiting" || inv.state === "in use") {
      const revoke = document.createElement("button");
      revoke.type = "button";
      revoke.textContent = "Revoke";
      revoke.addEventListener("click", () => postRevoke(inv.invitation_id).then(renderInvitations).catch((e) => notice(e.message, true)));
      cell.append(revoke);
    }
    row.append(cell);
    return row;
  });
  $("#invitations tbody").replaceChildren(...rows);
}
$("#invite").addEventListener("click", () => {
  $("#invite-box").classList.toggle("hidden");
  if (!$("#invite-box").classList.contains("hidden")) renderInvitations().catch((e) => notice(e.message, true));
});
$("#invite-make").addEventListener("click", async () => {
  try {
    const { url, expires_seconds: seconds } = await postInvitation($("#invite-name").value.trim());
    $("#invite-link").value = location.origin + url;
    $("#invite-minutes").textContent = String(Math.round(seconds / 60));
    $("#invite-made").classList.remove("hidden");
    $("#invite-link").select();
    await renderInvitations();
  } catch (e) { notice(e.message, true); }
});

// Other tabs of this page in this browser: they label under the same name, as one person. Each tab says it is here
// every 2 s; one silent for 5 s is gone.
const TAB_ID = Math.random().toString(36).slice(2);
const tabs = "BroadcastChannel" in window ? new BroadcastChannel("cleanrlhf-feedback") : null;
if (tabs) {
  tabs.onmessage = (ev) => {
    const { id, here } = ev.data || {};
    if (!id || id === TAB_ID) return;
    if (here) state.otherTabs.set(id, Date.now()); else state.otherTabs.delete(id);
    renderOtherTabs();
  };
  const sayHere = () => {
    tabs.postMessage({ id: TAB_ID, here: true });
    for (const [id, seen] of state.otherTabs) if (Date.now() - seen > 5000) state.otherTabs.delete(id);
    renderOtherTabs();
  };
  sayHere();
  setInterval(sayHere, 2000);
  window.addEventListener("pagehide", () => tabs.postMessage({ id: TAB_ID, here: false }));
}

getConfig().then((cfg) => { applyConfig(cfg); route(); })
  .catch((e) => { document.querySelector("main").textContent = e.message; });
