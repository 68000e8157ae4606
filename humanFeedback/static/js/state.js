// What the page knows: the answers kept in this browser and the state of the labelling view. Every other module
// reads and writes this one object; nothing here touches the DOM but `$`. The page holds no secret: the browser sends
// the session cookie the login route set (HttpOnly: no script here can read it).

const params = new URLSearchParams(location.search);

export const NAME_KEY = "cleanrlhf.feedback.annotator";
export const SPEED_KEY = "cleanrlhf.feedback.speed";
export const RUN_KEY = "cleanrlhf.feedback.run";
// Answers not yet acknowledged by the server, kept in this browser until they are: {query_id: {choice, ranking or ratings, annotator,
// run_id, session}}. They survive an outage, a reload and a closed tab, are sent again until the server answers
// (it stores a repeated answer once), and their pairs are never asked again meanwhile (excluded from /api/next).
const OUTBOX_KEY = "cleanrlhf.feedback.outbox";
if (params.get("run_id")) localStorage.setItem(RUN_KEY, params.get("run_id"));

export const KEYS = { ArrowLeft: "left", ArrowRight: "right", ArrowUp: "tie", ArrowDown: "skip" };
export const UNDO_KEY = "Backspace";
export const CHOICE_NAMES = { left: "Left is better", right: "Right is better", tie: "Tie", skip: "Skip" };
export const $ = (sel) => document.querySelector(sel);

export const state = {
  config: null,
  annotator: localStorage.getItem(NAME_KEY) || "",
  current: null,      // query shown now
  prefetched: null,   // next query, already leased and loading in the hidden pair
  prefetching: null,  // promise of an in-flight prefetch
  history: [],        // answered queries, newest last: {query, done: Promise<label|null>}
  pollTimer: null,
  loading: false,
  run: localStorage.getItem(RUN_KEY) || "",   // the run picked ("" = all runs)
  sessions: {},       // "run:session" -> {answered, total, seq}: the server's newest count (largest seq) of the session
  runTotals: {},      // run id -> {labelled, skipped, seq}: the server's newest count of the run's labels and skips
  lastSession: null,  // the session of the latest answer, for the line shown when no pair is waiting
  offlineSince: null,
  training: null,     // the trainers' news from the last "waiting" answer
  runState: null,     // GET /api/runs/<id>/progress of the run shown in the run panel
  latestEvaluation: null,   // id of the evaluation clip in the run panel
  reorder: null,            // the reward view's newest check as a query to reorder (GET .../evaluations), or null
  otherTabs: new Map(),     // id of another tab of this page in this browser -> when it last said so
};

export function outbox() {
  try { return JSON.parse(localStorage.getItem(OUTBOX_KEY) || "{}") || {}; } catch (e) { return {}; }
}
export function saveOutbox(box) { localStorage.setItem(OUTBOX_KEY, JSON.stringify(box)); }
export function unsentIds() { return Object.keys(outbox()).map(Number); }

// Counts from the server: each carries seq, the label sequence when it was counted, so an answer that arrives late
// (a prefetch leased before the last label) never overwrites a newer count, and an undo counts down.
export function noteProgress(runId, session, p) {
  if (!p) return;
  const key = `${runId}:${session}`;
  const rec = state.sessions[key];
  if (!rec || p.seq >= rec.seq) {
    state.sessions[key] = { answered: p.session_answered, total: Math.max(rec ? rec.total : 0, p.session_total), seq: p.seq };
  }
  noteRunCounts(runId, p);
}

export function noteRunCounts(runId, p) {
  const run = state.runTotals[runId];
  if (!run || p.seq >= run.seq) state.runTotals[runId] = { labelled: p.total_labelled, skipped: p.total_skipped, seq: p.seq };
}

// Answers kept in this browser, not yet counted by the server: of a run (and session), and of them the skips.
export function unsentIn(runId, session) {
  return Object.values(outbox()).filter((a) => a.run_id === runId && (session === undefined || a.session === session)).length;
}
export function unsentSkipsIn(runId) {
  return Object.values(outbox()).filter((a) => a.run_id === runId && a.choice === "skip").length;
}
