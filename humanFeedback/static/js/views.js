// What the person reads: the notice line, the progress line, the instructions, the trainers' news while no pair
// waits, the outbox warning, and the reward-model check view. Rendering only: no requests but the check view's.
import { getEvaluations, getRuns } from "./api.js";
import { pauseAll, speed } from "./player.js";
import { $, outbox, state, unsentIn } from "./state.js";

export function notice(text, isError = false) {
  const el = $("#notice");
  el.textContent = text || "";
  el.classList.toggle("error", !!isError);
}

export function setChoicesEnabled(on) {
  for (const b of document.querySelectorAll("button.choice")) b.disabled = !on;
}

export function renderProgress() {
  const q = state.current;
  const at = q ? { run: q.run_id, session: q.session } : state.lastSession;
  if (!at) { $("#progress").textContent = ""; return; }
  const rec = state.sessions[`${at.run}:${at.session}`];
  if (!rec) return;
  const labelled = Math.min(rec.total, rec.labelled + unsentIn(at.run, at.session));
  const total = (state.runTotals[at.run] || 0) + unsentIn(at.run);
  let text;
  if (q) {
    rec.shown = Math.max(rec.shown, Math.min(rec.total, labelled + 1));
    text = `Pair ${rec.shown} of ${rec.total} in session ${at.session}`;
  } else {
    text = `Session ${at.session}: ${labelled} of ${rec.total} pairs labelled`;
  }
  $("#progress").textContent = `${text} · ${total} labelled in total`;
}

export function renderInstructions(q) {
  const el = $("#instructions");
  el.replaceChildren(q.instructions || "Which clip is better?");
  const info = [];
  if (state.run === "" && q.run_name) info.push(`run ${q.run_name}`);
  if (q.clip_seconds) info.push(`each clip ${q.clip_seconds.toFixed(2)} s of the agent's time at ${speed()}× speed, looped`);
  if (info.length) {
    const span = document.createElement("span");
    span.className = "clip-info";
    span.textContent = ` (${info.join("; ")})`;
    el.append(span);
  }
}

function fmtSeconds(sec) {
  if (sec < 90) return `${Math.max(1, Math.round(sec))} s`;
  if (sec < 5400) return `${Math.round(sec / 60)} min`;
  return `${(sec / 3600).toFixed(1)} h`;
}

function renderTraining(reports) {
  const lines = (reports || []).filter((r) => !state.run || String(r.run_id) === state.run).map((r) => {
    const steps = r.total_steps ? `step ${r.step.toLocaleString("en")} of ${r.total_steps.toLocaleString("en")}` : `step ${r.step}`;
    let line = `Run ${r.run_name}: `;
    if (r.phase === "finished") line += `finished at ${steps}.`;
    else if (r.phase === "stopped") line += `stopped at ${steps} before its end; no pairs come until it is resumed.`;
    else if (r.phase === "labelling") line += `preparing the pairs of session ${r.session} (${r.session_size} pairs).`;
    else if (r.phase === "updating") line += `learning from your answers to session ${r.session}, then training goes on.`;
    else {
      line += `training is running, ${steps}.`;
      if (r.next_session_step === null || r.next_session_step === undefined) {
        line += r.sessions_total ? " No more sessions are planned." : "";
      } else {
        line += ` Next session (${r.sessions_done + 1} of ${r.sessions_total}) at step ${r.next_session_step.toLocaleString("en")}`;
        line += r.seconds_to_next_session !== null && r.seconds_to_next_session !== undefined
          ? `, in about ${fmtSeconds(r.seconds_to_next_session)}.` : ".";
      }
    }
    if (r.stale) line += ` (news from ${fmtSeconds(r.age_seconds)} ago; the trainer has not reported since.)`;
    return line;
  });
  $("#training-news").replaceChildren(...lines.map((t) => { const d = document.createElement("div"); d.textContent = t; return d; }));
}

export function showWaiting(training) {
  state.current = null;
  renderTraining(training);
  renderProgress();
  $("#instructions").textContent = "";
  $("#pairs").classList.add("hidden");
  $("#pairs").dataset.queryId = "";
  pauseAll();
  $("#waiting").classList.remove("hidden");
  setChoicesEnabled(false);
}

export function renderOutbox() {
  const n = Object.keys(outbox()).length;
  $("#outbox").textContent = n && state.offlineSince !== null
    ? `${n} answer${n > 1 ? "s" : ""} not sent yet: kept in this browser and sent when the server answers again (no need to answer again).`
    : "";
}

export function runLabel(r) {
  return `${r.run_id}: ${r.name}` + (r.env_id ? ` (${r.env_id})` : "");
}

// ------------------------------------------------------------------ reward-model check view

export async function loadRewards() {
  const select = $("#run-select");
  try {
    const { runs } = await getRuns();
    const chosen = select.value || (state.run || (runs.length ? String(runs[runs.length - 1].run_id) : ""));
    select.replaceChildren(...runs.map((r) => new Option(runLabel(r), String(r.run_id))));
    if (chosen) select.value = chosen;
    await renderEvaluations(select.value);
  } catch (e) {
    $("#rewards-empty").textContent = e.message;
    $("#rewards-empty").classList.remove("hidden");
  }
}

export async function renderEvaluations(runId) {
  const list = $("#rewards-list");
  list.replaceChildren();
  if (!runId) { $("#rewards-empty").classList.remove("hidden"); return; }
  const { evaluations } = await getEvaluations(runId);
  $("#rewards-empty").textContent = "No evaluation clips uploaded for this run yet.";
  $("#rewards-empty").classList.toggle("hidden", evaluations.length > 0);
  evaluations.forEach((ev, i) => {
    const card = document.createElement("div");
    card.className = "eval";
    const v = document.createElement("video");
    Object.assign(v, { muted: true, loop: true, playsInline: true, controls: true, preload: "metadata" });
    v.src = ev.url;
    v.playbackRate = speed();
    const info = document.createElement("div");
    const ret = document.createElement("span");
    ret.className = "ret";
    ret.textContent = `#${i + 1} · predicted return ${ev.predicted_return.toFixed(3)}`;
    info.append(ret, ` · step ${ev.step} · ${ev.clip}`);
    card.append(v, info);
    list.append(card);
  });
}
