// The labelling page. Every text from the server reaches the page as text nodes (markdown.js builds elements with
// textContent, never innerHTML), so an answer containing markup shows as characters. With an invite link the
// server knows who this is; otherwise the labeller types a name, kept in localStorage: a reload resumes.
// Everything that changes state is a POST; the pair shown is leased to this tab, renewed while it is visible and
// released when the tab closes.
"use strict";

const NAME_KEY = "alpacafarm-labeller";
const TOKEN = new URLSearchParams(window.location.search).get("token") || "";
const KEYS = { "1": "first", "2": "second", "t": "tie", "b": "both_bad", "s": "skip" };
const NAMES = { first: "first is better", second: "second is better", tie: "tie", both_bad: "both bad",
  skip: "skip" };
const RENEW_MS = 30000;
let mode = "name";
let labeller = null;
let current = null;
let busy = false;

const $ = (id) => document.getElementById(id);

function showOnly(id) {
  for (const section of ["login", "task", "done"]) $(section).hidden = section !== id;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function note(message) {
  $("note").textContent = message;
  $("note").hidden = !message;
}

function headers(json) {
  const out = {};
  if (TOKEN) out["X-Label-Token"] = TOKEN;
  if (json) out["Content-Type"] = "application/json";
  return out;
}

async function api(method, path, body) {
  const response = await fetch(path, { method, headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body) });
  let data = {};
  try { data = await response.json(); } catch (e) { data = {}; }
  if (!response.ok) {
    const error = new Error(data.error || `request failed (${response.status})`);
    error.status = response.status;
    throw error;
  }
  return data;
}

const who = () => (mode === "invite" ? {} : { labeller });

function setProgress(progress) {
  $("bar").max = Math.max(progress.session_pairs, 1);
  $("bar").value = progress.session_done;
  $("bar").title = `session: ${progress.session_done} of ${progress.session_pairs} pairs have their labels`;
  $("count").textContent = `${progress.labelled} labelled · ${progress.skipped} skipped · ${progress.left} left for you`;
  $("undo").disabled = progress.labelled + progress.skipped === 0;
}

function render(data) {
  setProgress(data.progress);
  if (data.done) {
    current = null;
    $("done-count").textContent = `You labelled ${data.progress.labelled} pairs and skipped ${data.progress.skipped}.`;
    $("undo-done").hidden = data.progress.labelled + data.progress.skipped === 0;
    showOnly("done");
    return;
  }
  current = data;
  $("task").dataset.pairId = data.pair_id;
  MD.render(data.instruction, $("instruction"));
  MD.render(data.input, $("input"));
  $("input-box").hidden = !data.input;
  MD.render(data.first, $("first"));
  MD.render(data.second, $("second"));
  $("first").parentElement.scrollTop = 0;
  $("second").parentElement.scrollTop = 0;
  showOnly("task");
}

function signedIn(name) {
  labeller = name;
  $("who-name").textContent = name;
  $("who").hidden = false;
  $("switch-box").hidden = mode === "invite";
  const team = new URL("/team", window.location.href);
  if (TOKEN) team.searchParams.set("token", TOKEN);
  $("team-link").href = team.pathname + team.search;
}

async function loadNext() {
  try {
    render(await api("POST", "/api/next", who()));
    showError("");
  } catch (e) {
    showError(e.message);
  }
}

function setBusy(value) {
  busy = value;
  document.body.dataset.state = value ? "busy" : "ready";  // tests (and styles) can wait for "ready"
  for (const button of document.querySelectorAll("button[data-choice], #undo")) button.disabled = value;
}

async function choose(choice) {
  if (!current || busy) return;
  setBusy(true);
  try {
    await api("POST", "/api/label", { ...who(), pair_id: current.pair_id, ticket: current.ticket, choice,
      reason: $("reason").value });
    $("reason").value = "";
    note("");
    await loadNext();
  } catch (e) {
    if (e.status === 409) {  // already stored (a double click, another tab): just move on
      await loadNext();
    } else {
      showError(e.message);
    }
  } finally {
    setBusy(false);
  }
}

async function undo() {
  if (busy) return;
  setBusy(true);
  try {
    const data = await api("POST", "/api/undo", who());
    render(data);
    $("reason").value = data.undone.reason || "";
    note(`Undone: you had chosen "${NAMES[data.undone.choice] || data.undone.choice}". Choose again.`);
    showError("");
  } catch (e) {
    showError(e.message);
  } finally {
    setBusy(false);
  }
}

function lease(action) {
  if (!current) return;
  fetch("/api/lease", { method: "POST", keepalive: true, headers: headers(true),
    body: JSON.stringify({ ...who(), ticket: current.ticket, action }) }).catch(() => {});
}

async function signIn(name) {
  try {
    const data = await api("POST", "/api/me", mode === "invite" ? {} : { labeller: name });
    if (mode !== "invite") localStorage.setItem(NAME_KEY, data.labeller);
    signedIn(data.labeller);
    await loadNext();
  } catch (e) {
    showError(e.message);
    if (mode !== "invite") showOnly("login");
  }
}

async function start() {
  for (const button of document.querySelectorAll("button[data-choice]")) {
    button.addEventListener("click", () => choose(button.dataset.choice));
  }
  $("undo").addEventListener("click", undo);
  $("undo-done").addEventListener("click", undo);
  document.addEventListener("keydown", (event) => {
    const typing = event.target instanceof HTMLTextAreaElement || event.target instanceof HTMLInputElement;
    if (typing) {
      if (event.key === "Escape") event.target.blur();
      return;
    }
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const key = event.key.toLowerCase();
    if (key === "u" && labeller) {
      event.preventDefault();
      undo();
      return;
    }
    const choice = KEYS[key];
    if (choice && current) {
      event.preventDefault();
      choose(choice);
    }
  });
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const name = $("name").value.trim();
    if (name) signIn(name);
  });
  $("switch").addEventListener("click", (event) => {
    event.preventDefault();
    lease("release");
    localStorage.removeItem(NAME_KEY);
    current = null;
    labeller = null;
    $("who").hidden = true;
    showOnly("login");
  });
  window.addEventListener("pagehide", () => lease("release"));
  setInterval(() => { if (document.visibilityState === "visible") lease("renew"); }, RENEW_MS);
  document.body.dataset.state = "ready";
  try {
    const session = await api("GET", "/api/session");
    mode = session.mode;
    $("guidelines-box").hidden = !session.guidelines;
    MD.render(session.guidelines, $("guidelines"));
  } catch (e) {
    showError(e.message);
    return;
  }
  if (mode === "invite") {
    signIn(null);
  } else if (localStorage.getItem(NAME_KEY)) {
    signIn(localStorage.getItem(NAME_KEY));
  } else {
    showOnly("login");
  }
}

start();
