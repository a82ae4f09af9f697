// The chat page: conversations streamed through /v1/chat/completions, as any OpenAI client would.
"use strict";

const $ = (id) => document.getElementById(id);
const els = {
  model: $("model"), temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"),
  system: $("system"), key: $("api-key"), remember: $("remember-key"), messages: $("messages"),
  error: $("error"), status: $("status"), form: $("composer"), prompt: $("prompt"), send: $("send"),
  stop: $("stop"), regenerate: $("regenerate"), clear: $("clear"), settings: $("settings"),
};

const history = []; // {role, content}, as sent to the API
let controller = null; // AbortController of the answer streaming now
let retryTimer = null;

function showError(err) {
  els.error.textContent = err ? err.message : "";
  els.error.hidden = !err;
  els.error.dataset.kind = err && err.kind ? err.kind : "";
  if (err && err.kind === "auth") els.settings.open = true;
  if (err && err.retryAfter) holdSend(err.retryAfter);
}

// After a 429 with Retry-After: Send waits that long, counting down.
function holdSend(seconds) {
  clearInterval(retryTimer);
  let left = Math.ceil(seconds);
  const tick = () => {
    if (left <= 0) {
      clearInterval(retryTimer);
      els.send.textContent = "Send";
      setBusy(false);
      return;
    }
    els.send.disabled = true;
    els.send.textContent = `Send (${left} s)`;
    left -= 1;
  };
  tick();
  retryTimer = setInterval(tick, 1000);
}

function setBusy(busy) {
  els.send.disabled = busy || els.send.textContent !== "Send";
  els.stop.disabled = !busy;
  els.regenerate.disabled = busy || !history.length || history[history.length - 1].role !== "assistant";
}

function addMessage(role, text) {
  const li = document.createElement("li");
  li.className = "message " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = text;
  li.append(who, body);
  els.messages.append(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

async function loadModels() {
  try {
    const resp = await apiFetch("/v1/models");
    const models = (await resp.json()).data || [];
    const chosen = els.model.value;
    els.model.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    if (models.some((m) => m.id === chosen)) els.model.value = chosen;
    showError(null);
  } catch (err) {
    showError(err);
  }
}

function numberOf(input) {
  const v = parseFloat(input.value);
  return Number.isFinite(v) ? v : undefined;
}

function request() {
  const messages = [];
  if (els.system.value.trim()) messages.push({ role: "system", content: els.system.value });
  messages.push(...history);
  const body = { model: els.model.value || undefined, messages, stream: true,
    stream_options: { include_usage: true } };
  const t = numberOf(els.temperature), p = numberOf(els.topP), n = numberOf(els.maxTokens);
  if (t !== undefined) body.temperature = t;
  if (p !== undefined) body.top_p = p;
  if (n !== undefined) body.max_tokens = Math.round(n);
  return body;
}

function describe(usage, t0, tFirst, tLast, stopped) {
  const parts = [];
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
  if (tFirst) parts.push(`TTFT ${fmtSeconds((tFirst - t0) / 1000)}`);
  const n = usage ? usage.completion_tokens : 0;
  if (n > 1 && tLast > tFirst) parts.push(`${((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tok/s`);
  if (stopped) parts.push("stopped");
  return parts.join(" · ");
}

// Streams one answer to the history as it stands.
async function answer() {
  showError(null);
  controller = new AbortController();
  setBusy(true);
  const li = addMessage("assistant", "");
  li.setAttribute("aria-busy", "true");
  const body = li.querySelector(".content");
  const meta = document.createElement("p");
  meta.className = "meta";
  li.append(meta);
  els.status.textContent = "Answering…";
  let text = "", usage = null, tFirst = 0, tLast = 0, stopped = false, failure = null;
  const t0 = performance.now();
  try {
    const resp = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request()),
      signal: controller.signal,
    });
    await readEvents(resp, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError("server", "The answer failed: " + chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        tLast = performance.now();
        if (!tFirst) tFirst = tLast;
        text += delta.content;
        body.textContent = text;
        li.scrollIntoView({ block: "end" });
      }
    });
  } catch (err) {
    if (err && err.name === "AbortError") stopped = true;
    else failure = err instanceof ApiError ? err : networkError(err);
  }
  controller = null;
  li.removeAttribute("aria-busy");
  if (text || usage) {
    history.push({ role: "assistant", content: text });
    meta.textContent = describe(usage, t0, tFirst, tLast, stopped);
  } else {
    li.remove(); // nothing came: the error (or the stop) says it all
    const asked = history[history.length - 1];
    if (failure && asked && asked.role === "user") {
      // the question goes back into the box, to be sent again once the error is dealt with
      history.pop();
      els.messages.lastElementChild.remove();
      if (!els.prompt.value) els.prompt.value = asked.content;
    }
  }
  els.status.textContent = stopped ? "Stopped." : failure ? "" : "Done.";
  if (failure) showError(failure);
  setBusy(false);
}

els.form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = els.prompt.value;
  if (!text.trim() || controller) return;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  els.prompt.value = "";
  answer();
});

els.prompt.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    if (!els.send.disabled) els.form.requestSubmit();
  }
});

document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && controller) controller.abort();
});

els.stop.addEventListener("click", () => controller && controller.abort());

els.regenerate.addEventListener("click", () => {
  if (controller || !history.length || history[history.length - 1].role !== "assistant") return;
  history.pop();
  const answers = els.messages.querySelectorAll(".message.assistant");
  answers[answers.length - 1].remove();
  answer();
});

els.clear.addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  els.messages.replaceChildren();
  els.status.textContent = "New conversation.";
  setBusy(false);
  els.prompt.focus();
});

bindKeyForm(els.key, els.remember, loadModels);
loadModels();
setBusy(false);
