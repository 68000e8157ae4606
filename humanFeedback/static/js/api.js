// The server's JSON API as the page calls it: one function per route, errors as ApiError with the HTTP status
// (undefined when the server did not answer at all). The browser's session cookie goes with every call; a 401 means
// it is gone (expired, or the server has another token now): the page makes way for the login page.

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function call(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  let body = options.body;
  if (body !== undefined && typeof body !== "string") {
    body = JSON.stringify(body);
    headers["Content-Type"] = "application/json";
  }
  const resp = await fetch(path, { method: options.method || "GET", headers, body, cache: "no-store" });
  let data = null;
  try { data = await resp.json(); } catch (e) { data = null; }
  if (resp.status === 401) location.assign("/");   // answers kept in this browser are sent after the login
  if (!resp.ok) throw new ApiError(resp.status, (data && data.error) || `HTTP ${resp.status}`);
  return data;
}

export const getConfig = () => call("/api/config");
export const getRuns = () => call("/api/runs");
export const getEvaluations = (runId) => call(`/api/runs/${encodeURIComponent(runId)}/evaluations`);
export const getLatestEvaluation = (runId) => call(`/api/runs/${encodeURIComponent(runId)}/evaluations?latest=1`);
export const getRunState = (runId) => call(`/api/runs/${encodeURIComponent(runId)}/progress`);
// The trainer's only (a browser logged in with the token or the trainer's login link): invitations for other people
export const postInvitation = (name) => call("/api/invitations", { method: "POST", body: name ? { name } : {} });
export const getInvitations = () => call("/api/invitations");
export const postRevoke = (id) => call(`/api/invitations/${encodeURIComponent(id)}/revoke`, { method: "POST", body: {} });

export function getNext({ annotator, runId, exclude }) {
  let url = "/api/next?annotator=" + encodeURIComponent(annotator);
  if (runId) url += "&run_id=" + encodeURIComponent(runId);
  if (exclude.length) url += "&exclude=" + exclude.join(",");
  return call(url);
}

// `answer`: {choice} (a pair, or a skip), {ranking: clip positions, best first}, or {ratings: each clip's, in order}
export const postLabel = (queryId, answer, annotator) =>
  call(`/api/queries/${queryId}/label`, { method: "POST", body: { ...answer, annotator } });

// `release`: the pairs this browser gives up for the undone one (its next pair), so that it never holds more than its cap
export const postUndo = (queryId, annotator, release) =>
  call(`/api/queries/${queryId}/undo`, { method: "POST", body: { annotator, release } });
