// What the page knows: the token taken from its address, the answers kept in this browser, and the state of the
// labelling view. Every other module reads and writes this one object; nothing here touches the DOM but `$`.

const params = new URLSearchParams(location.search);
export const TOKEN = params.get("token");
if (TOKEN) {
  // The server answered this page with the token as a cookie, which the browser now sends with every
  // request (clips and these modules included): drop ?token= from the address so it is not re-sent, logged or
  // bookmarked.
  params.delete("token");
  const rest = params.toString();
  history.replaceState(history.state, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
}

export const NAME_KEY = "cleanrlhf.feedback.annotator";
export const SPEED_KEY = "cleanrlhf.feedback.speed";
export const RUN_KEY = "cleanrlhf.feedback.run";
// Answers not yet acknowledged by the server, kept in this browser until they are: {query_id: {choice, annotator,
// run_id, session}}. They survive an outage, a reload and a closed tab, are sent again until the server answers
// (it stores a repeated answer once), and their pairs are never asked again meanwhile (excluded from /api/next).
const OUTBOX_KEY = "cleanrlhf.feedback.outbox";
if (params.get("run_id")) localStorage.setItem(RUN_KEY, params.get("run_id"));

export const KEYS = { ArrowLeft: "left", ArrowRight: "right", ArrowUp: "tie", ArrowDown: "skip" };
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
  sessions: {},       // "run:session" -> {labelled, total, shown}: only ever grows, so the progress line never goes back
  runTotals: {},      // run id -> labels of the run, as the server last said
  lastSession: null,  // the session of the latest answer, for the line shown when no pair is waiting
  offlineSince: null,
  training: null,     // the trainers' news from the last "waiting" answer
};

export function outbox() {
  try { return JSON.parse(localStorage.getItem(OUTBOX_KEY) || "{}") || {}; } catch (e) { return {}; }
}
export function saveOutbox(box) { localStorage.setItem(OUTBOX_KEY, JSON.stringify(box)); }
export function unsentIds() { return Object.keys(outbox()).map(Number); }

export function noteProgress(runId, session, p) {
  if (!p) return;
  const key = `${runId}:${session}`;
  const rec = state.sessions[key] || (state.sessions[key] = { labelled: 0, total: 0, shown: 0 });
  rec.labelled = Math.max(rec.labelled, p.session_labelled);
  rec.total = Math.max(rec.total, p.session_total);   // the size the trainer declared: fixed while pairs upload
  state.runTotals[runId] = Math.max(state.runTotals[runId] || 0, p.total_labelled);
}

export function unsentIn(runId, session) {
  return Object.values(outbox()).filter((a) => a.run_id === runId && (session === undefined || a.session === session)).length;
}
