// What the person reads: the notice line, the progress line, the instructions, the run panel (what the trainer does
// now and what the agent does), the trainers' news while no pair waits, the outbox warning, the other-tab warning,
// and the reward-model check view. Rendering only: no requests but the check view's.
import { componentOf, hideQueries, nounOf } from "./answers.js";
import { getEvaluations, getRuns } from "./api.js";
import { pauseAll, speed } from "./player.js";
import { $, outbox, state, unsentIn, unsentSkipsIn } from "./state.js";

export function notice(text, isError = false) {
  const el = $("#notice");
  el.textContent = text || "";
  el.classList.toggle("error", !!isError);
}

export function setChoicesEnabled(on) {
  for (const b of document.querySelectorAll("button.choice")) b.disabled = !on;
}

// "Pair k of N in session s · L labelled in total, S skipped" ("Ranking k of N", "Rating k of N" for a session of
// those): k counts the session's answered queries (skips too) and the one on screen; L counts labels, what the reward
// model learns from (a skip is none). Answers kept in this browser and not yet confirmed count as given.
export function renderProgress() {
  const q = state.current;
  const at = q ? { run: q.run_id, session: q.session, noun: componentOf(q).noun } : state.lastSession;
  if (!at) { $("#progress").textContent = ""; return; }
  const rec = state.sessions[`${at.run}:${at.session}`];
  if (!rec) return;
  const answered = Math.min(rec.total, rec.answered + unsentIn(at.run, at.session));
  const run = state.runTotals[at.run] || { labelled: 0, skipped: 0 };
  const skipped = run.skipped + unsentSkipsIn(at.run);
  const labelled = run.labelled + unsentIn(at.run) - unsentSkipsIn(at.run);
  const noun = at.noun || "pair";
  const text = q ? `${nounOf(q)} ${Math.min(rec.total, answered + 1)} of ${rec.total} in session ${at.session}`
    : `Session ${at.session}: ${answered} of ${rec.total} ${noun}s answered`;
  $("#progress").textContent = `${text} · ${labelled} labelled in total` + (skipped ? `, ${skipped} skipped` : "");
}

// The run panel: whether the trainer trains or waits for answers, its step, the run's labels so far, how often the
// reward model agrees with this person (when the trainer reports it), and the agent's latest evaluation clip.
export function renderRunState(info) {
  const el = $("#run-state");
  if (!info) { el.textContent = ""; el.dataset.phase = ""; return; }
  const p = info.progress;
  const steps = (r) => r.total_steps ? `step ${r.step.toLocaleString("en")} of ${r.total_steps.toLocaleString("en")}` : `step ${r.step}`;
  const heard = [p && p.age_seconds, info.trainer_seen_seconds].filter((x) => x !== null && x !== undefined);
  const silent = heard.length ? Math.min(...heard) : null;
  let phase, line;
  if (!p) {
    phase = "unknown";
    line = "The trainer has not reported yet.";
  } else if (p.phase === "finished" || p.phase === "stopped") {
    phase = p.phase;
    line = p.phase === "finished" ? `Training finished at ${steps(p)}.` : `Training stopped at ${steps(p)}; no pairs come until it is resumed.`;
  } else if (silent === null || silent > 120) {
    phase = "silent";
    line = `No news from the trainer for ${fmtSeconds(silent === null ? p.age_seconds : silent)} (last: ${steps(p)}); it may have stopped.`;
  } else if (p.phase === "labelling") {
    phase = "waiting";
    line = `Waiting for you: training is paused at ${steps(p)} until the pairs of session ${p.session} are answered.`;
  } else if (p.phase === "updating") {
    phase = "updating";
    line = `Learning from the answers to session ${p.session} (${steps(p)}); training goes on next.`;
  } else {
    phase = "training";
    line = `Training: ${steps(p)}` + (info.pending ? "; your answers are read as you give them." : ".");
  }
  const facts = [`${info.total_labelled} label${info.total_labelled === 1 ? "" : "s"} so far`];
  const agreement = p && p.agreement ? p.agreement[state.annotator] : undefined;
  if (agreement !== undefined) facts.push(`the reward model agrees with your answers on ${Math.round(agreement * 100)} % of pairs`);
  el.dataset.phase = phase;
  el.textContent = `${line} ${facts.join(" · ")}.`;
}

export function renderLatestEvaluation(evaluation) {
  const box = $("#latest-eval");
  box.classList.toggle("hidden", !evaluation);
  if (!evaluation || state.latestEvaluation === evaluation.evaluation_id) return;
  state.latestEvaluation = evaluation.evaluation_id;
  const v = box.querySelector("video");
  v.src = evaluation.url;
  v.dataset.evaluationId = String(evaluation.evaluation_id);
  const p = v.play();
  if (p && p.catch) p.catch(() => {});
  const step = evaluation.step.toLocaleString("en");
  box.querySelector("figcaption").textContent = evaluation.kind === "agent"
    ? `What the agent does now: its evaluation at step ${step} (mean return ${evaluation.predicted_return.toFixed(1)})`
    : `What the agent does now: its latest clip, step ${step}`;
}

export function renderOtherTabs() {
  const others = state.otherTabs.size;
  $("#other-tab").classList.toggle("hidden", others === 0);
  $("#other-tab").textContent = others === 0 ? "" : `This page is open in ${others === 1 ? "another tab" : `${others} other tabs`} `
    + `of this browser too: every tab labels as ${state.annotator || "the same name"}, one person, and may show the same pair. `
    + "To label as someone else, use another browser or a private window.";
}

export function renderInstructions(q) {
  const el = $("#instructions");
  const check = q.check_step === undefined ? ""
    : `The reward model's check clips of step ${q.check_step.toLocaleString("en")}: put them in your order, best first; it is learned as labels. `;
  el.replaceChildren(check + (q.instructions || "Which clip is better?"));
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
  hideQueries();
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

// Each render of the check view is numbered: the page routes to it on load and on every hash change, so two renders can
// await the server at once, and only the newest may draw (both drawing showed every clip twice).
let newestRender = 0;

export async function renderEvaluations(runId) {
  const render = ++newestRender;
  const list = $("#rewards-list");
  list.replaceChildren();
  if (!runId) { $("#rewards-empty").classList.remove("hidden"); return; }
  const { evaluations, reorder } = await getEvaluations(runId);
  if (render !== newestRender) return;
  state.reorder = reorder || null;   // the newest check's clips as a query to reorder (main.js shows it), or none
  $("#reorder-check").classList.toggle("hidden", !reorder);
  if (reorder) $("#reorder-check").textContent = `Put the ${reorder.clip_urls.length} clips of step ${reorder.check_step.toLocaleString("en")} in your order`;
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
