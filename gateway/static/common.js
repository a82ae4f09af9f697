// Shared by the chat page and the live view: the API key, SSE over fetch, and errors in words.
"use strict";

const KEY_NAME = "phaseserve.apiKey";

// The key lives in sessionStorage (gone with the tab) unless the person ticks "remember", then localStorage.
const apiKey = {
  get() {
    return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || "";
  },
  remembered() {
    return localStorage.getItem(KEY_NAME) !== null;
  },
  set(key, remember) {
    sessionStorage.removeItem(KEY_NAME);
    localStorage.removeItem(KEY_NAME);
    if (key) (remember ? localStorage : sessionStorage).setItem(KEY_NAME, key);
  },
};

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey.get();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// An error a person can act on. `kind` picks the wording; `retryAfter` is in seconds when the server said.
class ApiError extends Error {
  constructor(kind, message, status, retryAfter) {
    super(message);
    this.kind = kind;
    this.status = status || 0;
    this.retryAfter = retryAfter;
  }
}

async function errorFromResponse(resp) {
  let detail = "";
  try {
    const body = await resp.json();
    detail = (body && body.error && body.error.message) || "";
  } catch (_) { /* not JSON: the status says enough */ }
  const s = resp.status;
  if (s === 401) {
    const flag = "\u2011\u2011api\u2011key"; // non-breaking hyphens: "--api-key" stays on one line
    return new ApiError("auth", apiKey.get()
      ? `The API key was refused (401). Enter the key this server was started with (${flag}) under Settings.`
      : `This server needs an API key (401). Enter the one it was started with (${flag}) under Settings.`, s);
  }
  if (s === 429) {
    const after = parseInt(resp.headers.get("Retry-After") || "", 10);
    const wait = Number.isFinite(after) ? ` Try again in ${after} s.` : " Try again shortly.";
    return new ApiError("busy", "The server is busy (429)." + wait + (detail ? " " + detail : ""), s,
      Number.isFinite(after) ? after : undefined);
  }
  if (s === 503) {
    // the gateway's words say which: no live worker (starting, or they died), no Redis, shutting down
    return new ApiError("unavailable", "The server cannot serve this right now (503): " +
      (detail || "it is starting, or its workers died."), s);
  }
  if (s >= 500) {
    return new ApiError("server", `The server failed (${s})${detail ? ": " + detail : "."}`, s);
  }
  return new ApiError("request", `The request was refused (${s})${detail ? ": " + detail : "."}`, s);
}

function networkError(err) {
  return new ApiError("network", "Cannot reach the server (" + (err && err.message ? err.message : "network error") +
    "). Is `phaseserve up` still running?");
}

// POST/GET with the key; throws ApiError for an HTTP error or an unreachable server.
async function apiFetch(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = authHeaders(opts.headers);
  let resp;
  try {
    resp = await fetch(path, opts);
  } catch (err) {
    if (err && err.name === "AbortError") throw err;
    throw networkError(err);
  }
  if (!resp.ok) throw await errorFromResponse(resp);
  return resp;
}

// Server-sent events from a fetch response body: calls onData(text of the data lines) per event.
// (EventSource cannot send an Authorization header, so the stream is read by hand: events end at a
// blank line, `data:` lines join with "\n", comments (":") and other fields are skipped.)
async function readEvents(resp, onData) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5)).join("\n");
      if (data) onData(data);
    }
  }
}

// The key form in a page's settings: fills it from storage and saves on change.
function bindKeyForm(input, remember, onChange) {
  input.value = apiKey.get();
  remember.checked = apiKey.remembered();
  const save = () => {
    apiKey.set(input.value.trim(), remember.checked);
    if (onChange) onChange();
  };
  input.addEventListener("change", save);
  remember.addEventListener("change", save);
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}
