// The labelling page. Every text from the server is put on the page with textContent (never innerHTML), so an
// answer containing markup shows as characters. The labeller's name stays in localStorage: a reload resumes.
"use strict";

const NAME_KEY = "alpacafarm-labeller";
const TOKEN = new URLSearchParams(window.location.search).get("token") || "";
const KEYS = { "1": "first", "2": "second", "t": "tie", "s": "skip" };
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

async function api(method, path, body) {
  const headers = {};
  if (TOKEN) headers["X-Label-Token"] = TOKEN;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let data = {};
  try { data = await response.json(); } catch (e) { data = {}; }
  if (!response.ok) {
    const error = new Error(data.error || `request failed (${response.status})`);
    error.status = response.status;
    throw error;
  }
  return data;
}

function setProgress(progress) {
  $("bar").max = Math.max(progress.total, 1);
  $("bar").value = progress.done;
  $("count").textContent = `${progress.done} of ${progress.total} labelled`;
}

function render(data) {
  setProgress(data.progress);
  if (data.done) {
    current = null;
    $("done-count").textContent = `You labelled ${data.progress.done} pairs.`;
    showOnly("done");
    return;
  }
  current = data;
  $("task").dataset.pairId = data.pair_id;
  $("instruction").textContent = data.instruction;
  $("input").textContent = data.input;
  $("input-box").hidden = !data.input;
  $("first").textContent = data.first;
  $("second").textContent = data.second;
  $("first").parentElement.scrollTop = 0;
  $("second").parentElement.scrollTop = 0;
  showOnly("task");
}

async function loadNext() {
  const name = localStorage.getItem(NAME_KEY);
  $("who-name").textContent = name;
  $("who").hidden = false;
  try {
    render(await api("GET", `/api/next?labeller=${encodeURIComponent(name)}`));
    showError("");
  } catch (e) {
    showError(e.message);
  }
}

function setBusy(value) {
  busy = value;
  document.body.dataset.state = value ? "busy" : "ready";  // tests (and styles) can wait for "ready"
  for (const button of document.querySelectorAll("button[data-choice]")) button.disabled = value;
}

async function choose(choice) {
  if (!current || busy) return;
  setBusy(true);
  try {
    await api("POST", "/api/label", {
      labeller: localStorage.getItem(NAME_KEY), pair_id: current.pair_id, ticket: current.ticket, choice,
      reason: $("reason").value,
    });
    $("reason").value = "";
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

function start() {
  for (const button of document.querySelectorAll("button[data-choice]")) {
    button.addEventListener("click", () => choose(button.dataset.choice));
  }
  document.addEventListener("keydown", (event) => {
    const typing = event.target instanceof HTMLTextAreaElement || event.target instanceof HTMLInputElement;
    if (typing) {
      if (event.key === "Escape") event.target.blur();
      return;
    }
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const choice = KEYS[event.key.toLowerCase()];
    if (choice && current) {
      event.preventDefault();
      choose(choice);
    }
  });
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const name = $("name").value.trim();
    if (!name) return;
    localStorage.setItem(NAME_KEY, name);
    loadNext();
  });
  $("switch").addEventListener("click", (event) => {
    event.preventDefault();
    localStorage.removeItem(NAME_KEY);
    current = null;
    $("who").hidden = true;
    showOnly("login");
  });
  document.body.dataset.state = "ready";
  if (localStorage.getItem(NAME_KEY)) {
    loadNext();
  } else {
    showOnly("login");
  }
}

start();
