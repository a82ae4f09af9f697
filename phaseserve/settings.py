"""Every setting of every service in one table: flag, environment variable, default, help.

Each service builds its argparse parser from the settings it uses; a flag wins
over the environment, the environment over the default. docs/settings.md is this
table as `phaseserve settings` prints it (a test keeps the two equal).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from phaseserve import redis_url
from phaseserve.models import model_source
from phaseserve.models.model_source import ResolvedModel, bundled_model_path  # noqa: F401 (re-exported)
from phaseserve.lora import DEFAULT_MAX_LORA_RANK
from phaseserve.setting_types import (  # noqa: F401 (the parsers are re-exported: services read them here)
    Setting, lora_module_arg, nonnegative_float, parse_bool, parse_itl_target_arg, parse_size,
    parse_speculative_config_arg)


ALL = ("gateway", "scheduler", "worker", "up")

SETTINGS: list[Setting] = [
    Setting("redis_url", "REDIS_URL", None, str,
            "Redis to use (a password goes in the URL: `redis://:PASSWORD@host:port/0`), a primary its "
            "sentinels fail over (`redis+sentinel://:PASSWORD@host:26379,host2:26379/mymaster/0`) or a cluster "
            "(`redis+cluster://:PASSWORD@host:6379,host2:6379`): docs/redis.md; `up` starts an "
            "embedded private server, with a generated password, when unset", ALL, secret=True),
    Setting("redis_password_file", "PHASESERVE_REDIS_PASSWORD_FILE", None, str,
            "a file holding Redis's password, put into --redis-url's (docker-compose generates one at first "
            "start): the password stays out of every environment and command line", ALL),
    Setting("key_prefix", "PHASESERVE_KEY_PREFIX", "ps", str,
            "prefix of every Redis key, stream and channel (lets stacks share a Redis)", ALL),
    Setting("model", "PHASESERVE_MODEL", None, str,
            "what to serve: a Hugging Face folder, a .gguf file (or a folder holding one), a hub id (org/name), "
            "`bundled` (the tests' small model); default: SmolLM2-135M-Instruct, fetched once into the cache",
            ("gateway", "worker", "up")),
    Setting("cache_dir", "PHASESERVE_CACHE_DIR", None, str,
            "where fetched and converted models are kept; default: $XDG_CACHE_HOME/phaseserve, else "
            "~/.cache/phaseserve", ("gateway", "worker", "up")),
    Setting("served_model_name", "PHASESERVE_SERVED_MODEL_NAME", None, str,
            "model id in the API; default: the model's own name (hub id, GGUF or folder name)", ("gateway", "up")),
    Setting("host", "PHASESERVE_HOST", "127.0.0.1", str, "gateway bind address", ("gateway", "up")),
    Setting("port", "PHASESERVE_PORT", 8000, int, "gateway port", ("gateway", "up")),
    Setting("gateway_id", "PHASESERVE_GATEWAY_ID", None, str,
            "gateway identity (pub/sub channel); default: random", ("gateway",)),
    Setting("max_body_bytes", "PHASESERVE_MAX_BODY_BYTES", 1 << 20, parse_size,
            "largest accepted request body (413 above)", ("gateway", "up")),
    Setting("max_waiting_requests", "PHASESERVE_MAX_WAITING", 1024, int,
            "requests a gateway keeps in flight before answering 429", ("gateway", "up")),
    # --- overload, abuse and delivery (gateway side)
    Setting("redis_max_connections", "PHASESERVE_REDIS_MAX_CONNECTIONS", 64, int,
            "Redis connections a gateway opens for commands at most; a burst beyond waits for one "
            "(--redis-pool-timeout) instead of failing", ("gateway", "up")),
    Setting("redis_wait_replicas", "PHASESERVE_REDIS_WAIT_REPLICAS", None, int,
            "replicas that must hold an accepted request before the gateway answers (Redis WAIT after the "
            "submit); default: 1 with a redis+sentinel:// URL, else 0 (no WAIT). See docs/redis.md",
            ("gateway", "up")),
    Setting("redis_wait_timeout", "PHASESERVE_REDIS_WAIT_TIMEOUT", 0.5, float,
            "seconds a submit's WAIT waits for the replicas; past it the request is served anyway (a warning "
            "is logged): a replica that is down slows submits by this much, never stops them", ("gateway", "up")),
    Setting("redis_pool_timeout", "PHASESERVE_REDIS_POOL_TIMEOUT", 30.0, float,
            "seconds a gateway command waits for a free Redis connection before answering 503", ("gateway", "up")),
    Setting("max_queued_prompt_tokens", "PHASESERVE_MAX_QUEUED_PROMPT_TOKENS", 262144, int,
            "prompt tokens (times n) of a gateway's requests still waiting for their first token, at most; "
            "beyond, 429 (a request alone is always let through)", ("gateway", "up")),
    Setting("tool_call_parser", "PHASESERVE_TOOL_CALL_PARSER", "hermes", str,
            "the format of the model's tool calls, parsed out of chat outputs into `tool_calls` (vLLM's flag); "
            "`hermes`: `<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>`", ("gateway", "up"),
            choices=("hermes",)),
    Setting("max_grammar_choices", "PHASESERVE_MAX_GRAMMAR_CHOICES", 10000, int,
            "options a `guided_choice` (or `structured_outputs.choice`) may list; 400 beyond", ("gateway", "up")),
    Setting("max_grammar_bytes", "PHASESERVE_MAX_GRAMMAR_BYTES", "64KiB", parse_size,
            "size of a client's regex or Lark grammar (`guided_regex`, `guided_grammar`, `structured_outputs`), "
            "and of a choice's options together, in UTF-8 bytes; 400 beyond", ("gateway", "up")),
    Setting("max_schema_bytes", "PHASESERVE_MAX_SCHEMA_BYTES", "256KiB", parse_size,
            "size of a JSON schema (`response_format`, `guided_json`, `structured_outputs.json`) and of the "
            "grammar a forced tool call makes of the tools' parameters, in UTF-8 bytes; 400 beyond",
            ("gateway", "up")),
    Setting("grammar_check_timeout", "PHASESERVE_GRAMMAR_CHECK_TIMEOUT", 5.0, float,
            "seconds the gateway's proof of a grammar (compile, first mask, a few tokens walked) may take; "
            "beyond, the request is a 400 and its client's slot stays taken until the engine returns",
            ("gateway", "up")),
    Setting("grammar_check_threads", "PHASESERVE_GRAMMAR_CHECK_THREADS", 2, int,
            "threads that prove grammars at a gateway; a client (an API key, or an address when keys are off) "
            "has one proof at a time, so one client never holds more than one of them", ("gateway", "up")),
    Setting("grammar_queue_timeout", "PHASESERVE_GRAMMAR_QUEUE_TIMEOUT", 10.0, float,
            "seconds a constrained request waits for its client's proof slot (429 beyond) and then for a free "
            "thread (503 beyond)", ("gateway", "up")),
    Setting("keepalive_timeout", "PHASESERVE_KEEPALIVE_TIMEOUT", 20.0, float,
            "seconds a connection may go without a complete request's headers, from when it opened or answered "
            "its last request: an idle keep-alive connection, and a client sending its headers slowly, are "
            "closed then (aiohttp has one timer for both)", ("gateway", "up")),
    Setting("body_timeout", "PHASESERVE_BODY_TIMEOUT", 30.0, float,
            "seconds a client has to send a request's whole body once its headers are in; a slower one gets "
            "408 and its connection is closed", ("gateway", "up")),
    Setting("reasoning_parser", "PHASESERVE_REASONING_PARSER", "none", str,
            "how a reasoning model's thinking is split from its answer (vLLM's flag): `deepseek_r1`, `qwen3` "
            "(`<think>…</think>`) put it in `reasoning_content` (chat) and a reasoning item (Responses), and "
            "structured outputs and forced tool calls apply after it; `none`: the output is all content",
            ("gateway", "up"), choices=("none", "deepseek_r1", "qwen3")),
    Setting("responses_ttl", "PHASESERVE_RESPONSES_TTL", 86400.0, float,
            "seconds a stored Response (`/v1/responses` with `store`, the default) stays in Redis, its whole "
            "conversation with it, for `previous_response_id` and GET; each costs Redis memory about its "
            "conversation's text: size Redis for the responses stored within this time", ("gateway", "up")),
    Setting("retry_after", "PHASESERVE_RETRY_AFTER", 1, int,
            "seconds the Retry-After header of a 429 asks clients to wait", ("gateway", "up")),
    Setting("priority_min", "PHASESERVE_PRIORITY_MIN", 0, int,
            "lowest `priority` a request may set (lower is served first; 400 outside the range); the default "
            "range lets clients only lower their own priority", ("gateway", "up")),
    Setting("priority_max", "PHASESERVE_PRIORITY_MAX", 10, int,
            "highest `priority` a request may set", ("gateway", "up")),
    Setting("api_key", "PHASESERVE_API_KEY", None, str,
            "bearer API keys the /v1 routes require (comma-separated; 401 without one); /health and /metrics "
            "stay open; default: no key needed", ("gateway", "up"), secret=True),
    Setting("api_key_file", "PHASESERVE_API_KEY_FILE", None, str,
            "a file of API keys, one a line (added to --api-key)", ("gateway", "up")),
    Setting("api_keys_file", "PHASESERVE_API_KEYS_FILE", None, str,
            "API keys as tenants: a YAML or JSON file naming each key's tenant, and each tenant's weight, "
            "priority range, limits and prefix-cache sharing (docs/tenants.md); reloaded when it changes; "
            "added to --api-key", ("gateway", "up")),
    Setting("api_keys_reload_interval", "PHASESERVE_API_KEYS_RELOAD_INTERVAL", 1.0, float,
            "seconds between looks at --api-keys-file for changes (a file that does not parse is logged and "
            "the keys before it stay)", ("gateway", "up")),
    Setting("token_silence_timeout", "PHASESERVE_TOKEN_SILENCE_TIMEOUT", 1.0, float,
            "seconds without a token on the channel after which a running request's tokens are re-read from "
            "its durable token log (pub/sub may drop messages)", ("gateway", "up")),
    Setting("request_progress_timeout", "PHASESERVE_REQUEST_PROGRESS_TIMEOUT", 60.0, float,
            "a request with no progress for this many seconds ends with an error (504, or an error event in a "
            "stream) and is cancelled. Progress: a new token, or the scheduler's word that the request waits "
            "in its queue or is prefilling a long prompt", ("gateway", "up")),
    Setting("client_write_timeout", "PHASESERVE_CLIENT_WRITE_TIMEOUT", 30.0, float,
            "seconds a streaming client may leave a write unread (its connection's buffers full); a slower "
            "client is disconnected and its request cancelled, freeing its slot; 0 = no deadline",
            ("gateway", "up")),
    Setting("stream_buffer_events", "PHASESERVE_STREAM_BUFFER_EVENTS", 4096, int,
            "token events a streaming request may have waiting for its client to take them; beyond, the "
            "client is disconnected and its request cancelled; 0 = no cap", ("gateway", "up")),
    Setting("resume_grace", "PHASESERVE_RESUME_GRACE", 10.0, float,
            "seconds a resumable request (X-Resume: 1) whose client went away keeps generating, waiting for "
            "the client to resume it (Last-Event-ID) on any gateway, before it is cancelled",
            ("gateway", "scheduler", "up")),
    Setting("client_lease_ttl", "PHASESERVE_CLIENT_LEASE_TTL", 5.0, float,
            "a gateway serving a client refreshes the request's lease key every third of this; a lease gone "
            "this long means no gateway serves the request", ("gateway", "scheduler", "up")),
    Setting("worker_id", "PHASESERVE_WORKER_ID", None, str,
            "worker identity; default: hostname-pid", ("worker",)),
    Setting("host_id", "PHASESERVE_HOST_ID", None, str,
            "the host this worker reports: workers with the same host id hand KV over through shared memory "
            "(--kv-transport auto), others through Redis; default: hostname/net:<network namespace>, so "
            "network namespaces of one machine count as hosts of their own", ("worker",)),
    Setting("role", "PHASESERVE_ROLE", "mixed", str,
            "worker phase role: mixed (prefill and decode), prefill (hands each sequence to a decode worker "
            "after its first token), decode (takes them; prefills only when no other worker exists)",
            ("worker",), ("mixed", "prefill", "decode")),
    Setting("device", "PHASESERVE_DEVICE", "auto", str,
            "where the worker runs the model: auto (cuda if available), cpu, cuda", ("worker", "up")),
    Setting("dtype", "PHASESERVE_DTYPE", "auto", str,
            "model dtype: auto (what the hardware computes natively: the checkpoint's on CUDA and on a CPU with "
            "AVX512-BF16, fp16 there served as bf16; float32 on other CPUs), bfloat16, float32",
            ("worker", "up"), ("auto", "bfloat16", "float32", "float16")),
    Setting("quantization", "PHASESERVE_QUANTIZATION", "auto", str,
            "linear weights in memory: none (model dtype), int8 or int4 (block-32, quantized at load unless "
            "the GGUF file already is), auto (a GGUF file's Q8_0/Q4_0/Q4_1 weights as stored where a fast "
            "quantized kernel runs, else none)", ("worker", "up"), ("none", "int8", "int4", "auto")),
    Setting("activation_quant", "PHASESERVE_ACTIVATION_QUANT", "auto", str,
            "float32 activations of quantized linears on a CPU with AVX2 + FMA: int8 (each row's 32-element "
            "blocks quantized to int8, integer dot products as llama.cpp does: faster, moves the numbers), none "
            "(multiplied as they are), auto (int8 where float32 is the default dtype, a CPU without AVX512-BF16: "
            "it moves perplexity less than the int4 weights do, see docs/decisions.md; none elsewhere); ignored "
            "for bf16 and on CUDA",
            ("worker", "up"), ("none", "int8", "auto")),
    Setting("block_size", "PHASESERVE_BLOCK_SIZE", 16, int, "tokens per KV-cache block", ("worker", "up")),
    Setting("kv_cache_memory", "PHASESERVE_KV_CACHE_MEMORY", "1GiB", parse_size,
            "KV-cache budget per worker (e.g. 512MiB, 4GiB); sets the number of blocks", ("worker", "up")),
    Setting("num_threads", "PHASESERVE_NUM_THREADS", 0, int,
            "torch CPU threads for the worker; 0 = auto: measured once per model and machine (a decode step on every core against one fewer, plus the other services' share of a step), cached in the cache dir", ("worker", "up")),
    Setting("bind_cores", "PHASESERVE_BIND_CORES", True, parse_bool,
            "`up` only: when the worker uses fewer threads than there are cores, run it on cores of its own "
            "and the gateway, scheduler and Redis on the rest, so they never preempt a model step", ("up",)),
    Setting("workers", "PHASESERVE_WORKERS", None, int,
            "`up` only: how many mixed workers to start, each with its share of the cores and its own KV "
            "cache (--kv-cache-memory each); default: 1, or 0 when --prefill-workers or --decode-workers is "
            "given", ("up",)),
    Setting("prefill_workers", "PHASESERVE_PREFILL_WORKERS", 0, int,
            "`up` only: how many prefill-role workers to start (--role prefill), beside the mixed ones; each "
            "gets the same share of the cores as every other worker", ("up",)),
    Setting("decode_workers", "PHASESERVE_DECODE_WORKERS", 0, int,
            "`up` only: how many decode-role workers to start (--role decode), beside the mixed ones",
            ("up",)),
    Setting("relay_cpus", "PHASESERVE_RELAY_CPUS", None, str,
            "CPUs of the worker's Redis relay process, e.g. 1 or 2-3 (`up --bind-cores` gives it the other "
            "services' cores); default: wherever the worker may run", ("worker",)),
    Setting("max_model_len", "PHASESERVE_MAX_MODEL_LEN", 0, int,
            "longest sequence (prompt + output); 0 = the model's limit", ("worker", "gateway", "up")),
    Setting("max_num_seqs", "PHASESERVE_MAX_NUM_SEQS", 64, int,
            "sequences in one step at most", ("scheduler", "up")),
    Setting("max_num_batched_tokens", "PHASESERVE_MAX_NUM_BATCHED_TOKENS", 512, int,
            "token budget of one step (decodes + prefill chunks; tokens weighted by context, see --attention-horizon)", ("scheduler", "up")),
    Setting("enable_chunked_prefill", "PHASESERVE_CHUNKED_PREFILL", True, parse_bool,
            "split long prompts into chunks that fit beside the decodes", ("scheduler", "up")),
    Setting("enable_prefix_caching", "PHASESERVE_PREFIX_CACHING", True, parse_bool,
            "reuse the KV blocks of prompt prefixes a worker computed before (a resent chat history, a shared "
            "system prompt, the n choices of one request) and route each request to the worker holding the "
            "longest prefix of it, within a margin of the least loaded; --no-enable-prefix-caching turns it off",
            ("scheduler", "up")),
    Setting("attention_horizon", "PHASESERVE_ATTENTION_HORIZON", None, int,
            "prefill cost model: a token attending to c tokens costs 1 + c/K of the step's token budget, so "
            "chunks deep in a long prompt are smaller; K default: each worker's estimate from its model's "
            "shape; 0 = off (every token costs 1)", ("scheduler", "up")),
    Setting("long_prefill_threshold", "PHASESERVE_LONG_PREFILL_THRESHOLD", 256, int,
            "prompts longer than this many tokens are long: in a step with decodes their prefill chunks take at "
            "most this many units of its budget together, so streams decoding beside a long prompt stall less "
            "while short prompts still fill the budget (a step with no decode is not capped, unless two tenants "
            "have used the worker: docs/tenants.md); 0 = no cap", ("scheduler", "up")),
    Setting("kv_transport", "PHASESERVE_KV_TRANSPORT", "auto", str,
            "how a prefill worker's KV reaches a decode worker: auto (shared memory when both run on one host, "
            "else Redis), shm, redis", ("scheduler", "up"), ("auto", "shm", "redis")),
    Setting("itl_target", "PHASESERVE_ITL_TARGET", "1.3x", parse_itl_target_arg,
            "bound on a step's time while streams decode, from each worker's step costs learned from its "
            "measured steps: a ratio of the predicted decode-only step at that batch (e.g. 1.5x) or "
            "milliseconds (e.g. 80ms); the chunks of long prompts (over --long-prefill-threshold) get only "
            "what is left under it, so they wait (their TTFT grows) instead of the streams' inter-token "
            "latency, for at most --itl-patience from the start of their prefill; off = no bound",
            ("scheduler", "up")),
    Setting("itl_patience", "PHASESERVE_ITL_PATIENCE", 15.0, nonnegative_float,
            "seconds of predicted step time the ITL target may hold a long prompt's prefill back; past it only "
            "the token budget and the long cap bound its chunks, so no prompt starves beside a few streams; keep "
            "it well under --request-progress-timeout", ("scheduler", "up")),
    Setting("tenant_wait", "PHASESERVE_TENANT_WAIT", 0.1, nonnegative_float,
            "seconds of predicted step time a request may wait for another tenant's work already sent to a "
            "worker: once two tenants (--api-keys-file) have used a worker, the long prompts' chunks of a step with "
            "no decode keep it within this and are not pipelined behind another plan; shorter costs a flood of "
            "long prompts more steps' fixed cost (docs/tenants.md); 0 = only the long cap bounds them",
            ("scheduler", "up")),
    Setting("plan_ahead", "PHASESERVE_PLAN_AHEAD", 0.1, nonnegative_float,
            "seconds of predicted step time a worker's plans in flight may add up to before the scheduler "
            "plans another behind them: a second plan in flight hides the round trip between a step's result "
            "and the next plan, but behind a long step (a long prompt's chunks on a slow CPU) a request "
            "arriving now would wait for both; 0 = one plan at a time", ("scheduler", "up")),
    Setting("speculative_config", "PHASESERVE_SPECULATIVE_CONFIG", None, parse_speculative_config_arg,
            "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
            "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}, or {\"method\": \"draft_model\", \"model\": "
            "PATH, \"num_speculative_tokens\": 3} (a model with the same tokenizer; its KV cache takes half of "
            "--kv-cache-memory); each decode verifies up to that many tokens the worker proposes, and the scheduler chooses fewer (or none) per sequence and step from measured "
            "acceptance and the worker's learned step cost (\"adaptive\": false: always the most); off when unset "
            "(docs/speculative.md)", ("worker", "up")),
    Setting("lora_modules", "PHASESERVE_LORA_MODULES", None, lora_module_arg,
            "LoRA adapters served as models from the start, vLLM's form `name=PATH` (or JSON {\"name\": ..., "
            "\"path\": ...}), several allowed: PEFT folders (adapter_config.json + adapter_model.safetensors) "
            "that every worker can read (a shared volume across hosts); more are loaded and unloaded at run time "
            "by POST /v1/load_lora_adapter and /v1/unload_lora_adapter (docs/lora.md)", ("gateway", "up"),
            repeatable=True),
    Setting("max_loras", "PHASESERVE_MAX_LORAS", 8, int,
            "LoRA adapters a worker keeps loaded; past it the least recently used is dropped (and loaded again "
            "from its folder when a request needs it); a step needing more holds them all until it ends",
            ("worker", "up")),
    Setting("max_lora_rank", "PHASESERVE_MAX_LORA_RANK", DEFAULT_MAX_LORA_RANK, int,
            "the highest LoRA rank served (a higher one is refused when loaded); every adapter is padded to it "
            "so the LoRA op's shapes never depend on the batch (one numerics): keep it as low as the adapters "
            "allow", ("gateway", "worker", "up")),
    Setting("heartbeat_interval", "PHASESERVE_HEARTBEAT_INTERVAL", 1.0, float,
            "seconds between worker heartbeats", ("worker", "scheduler", "up")),
    Setting("heartbeat_ttl", "PHASESERVE_HEARTBEAT_TTL", 5.0, float,
            "a worker silent this long is considered dead", ("worker", "scheduler", "up")),
    Setting("step_timeout", "PHASESERVE_STEP_TIMEOUT", 30.0, float,
            "seconds a worker's model step may take (from when its plan is due) before the step counts as lost: "
            "the scheduler re-plans its sequences, and a worker whose model is stuck that long stops "
            "heartbeating and is treated as dead. The scheduler's value goes with each plan (scaled up for a "
            "step larger than its token budget); a worker's own is for plans that carry none. Once the "
            "scheduler has learned a worker's step costs, a step's deadline is shorter: see "
            "--step-timeout-factor",
            ("worker", "scheduler", "up")),
    Setting("step_timeout_factor", "PHASESERVE_STEP_TIMEOUT_FACTOR", 10.0, float,
            "once the scheduler has learned a worker's step costs, a step may take this many times its "
            "predicted time (at least --step-timeout-floor, at most --step-timeout) before the worker's model "
            "counts as frozen and its sequences move; a worker's first steps (still warming up) keep "
            "--step-timeout. 0: always --step-timeout", ("scheduler", "up")),
    Setting("step_timeout_floor", "PHASESERVE_STEP_TIMEOUT_FLOOR", 3.0, float,
            "the least a step's learned deadline (--step-timeout-factor) may be, in seconds: a step slowed by "
            "a busy machine is not a frozen one", ("scheduler", "up")),
    Setting("grammar_prepare_timeout", "PHASESERVE_GRAMMAR_PREPARE_TIMEOUT", 10.0, float,
            "seconds a worker may take to prepare a constrained sequence (build its grammar matcher over the "
            "outputs it has, and its first token mask) once it has started on it; meanwhile the sequence sits "
            "out the steps (the others go on), and past this it fails alone with an error (400, or an error "
            "event in a stream)", ("worker", "up")),
    Setting("quarantine_after", "PHASESERVE_QUARANTINE_AFTER", 2, int,
            "a sequence running on this many workers that died or whose model step overran its deadline is "
            "failed with an error (422) instead of being moved to another worker again: a poison request is "
            "dead-lettered, counted in /metrics, and takes no more workers down. 0: never", ("scheduler", "up")),
    Setting("drain_timeout", "PHASESERVE_DRAIN_TIMEOUT", 30.0, float,
            "a worker given SIGTERM drains: the scheduler moves its waiting sequences to other workers at "
            "once, lets its running ones finish for up to this many seconds, then recomputes the rest "
            "elsewhere and lets it exit (0: hand everything back at once). A worker no scheduler answers "
            "exits a few seconds after this; a second SIGTERM, or SIGINT, stops it at once",
            ("worker", "scheduler", "up")),
    Setting("scheduler_lease_ttl", "PHASESERVE_SCHEDULER_LEASE_TTL", 5.0, float,
            "seconds the active scheduler's lease lasts unrenewed; a second scheduler is a standby that takes "
            "over (with a new epoch) once the lease lapses", ("scheduler", "up")),
    Setting("log_level", "PHASESERVE_LOG_LEVEL", "info", str, "log level", ALL),
    Setting("log_json", "PHASESERVE_LOG_JSON", False, parse_bool, "JSON log lines", ALL),
]

BY_NAME = {s.name: s for s in SETTINGS}


def settings_for(service: str) -> list[Setting]:
    return [s for s in SETTINGS if service in s.services]


def add_arguments(parser: argparse.ArgumentParser, service: str) -> None:
    """Add the flags of `service`; defaults come from the environment, then the table."""
    for s in settings_for(service):
        env = os.environ.get(s.env)
        if s.repeatable:
            default = [s.type(v) for v in env.split()] if env else []
        else:
            default = s.type(env) if env is not None else s.default
        kwargs: dict[str, Any] = dict(default=default, help=help_text(s, default))
        if s.repeatable:
            kwargs.update(type=s.type, nargs="+", action="extend")
        elif s.type is parse_bool:
            kwargs.update(type=parse_bool, nargs="?", const=True, metavar="BOOL")
        else:
            kwargs.update(type=s.type)
        if s.choices:
            kwargs["choices"] = s.choices
        parser.add_argument(s.flag, dest=s.name, **kwargs)
        if s.type is parse_bool:  # vLLM's spelling of "off": --no-enable-prefix-caching
            parser.add_argument("--no-" + s.flag[2:], dest=s.name, action="store_false",
                                help=f"{s.flag} false")


def help_text(s: Setting, default: Any) -> str:
    """A flag's --help: what it does, its environment variable, its default (argparse formats help with %)."""
    shown = f"; default: {_shown_default(default)}" if default is not None else ""
    return f"{s.help} [env {s.env}{shown}]".replace("%", "%%")


def _shown_default(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse(service: str, argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog or f"phaseserve {service}")
    add_arguments(parser, service)
    args = parser.parse_args(argv)
    try:
        args.redis_url = with_password_file(args.redis_url, args.redis_password_file)
    except OSError as e:
        parser.error(f"--redis-password-file: {e}")
    if args.redis_url:
        try:
            redis_url.parse(args.redis_url)
        except redis_url.RedisUrlError as e:
            parser.error(f"--redis-url: {e}")
    args.key_prefix = redis_url.key_prefix_for(args.redis_url, args.key_prefix)
    return args


def with_password_file(url: str | None, path: str | None) -> str | None:
    """`url` with its password read from the file at `path` (whitespace around it dropped), or `url` as it
    is when either is unset."""
    if not url or not path:
        return url
    return redis_url.with_password(url, Path(path).read_text().strip())


def markdown_table() -> str:
    rows = ["| flag | environment | default | services | meaning |", "| --- | --- | --- | --- | --- |"]
    for s in SETTINGS:
        default = "—" if s.default is None else f"`{s.default}`"
        rows.append(f"| `{s.flag}` | `{s.env}` | {default} | {', '.join(s.services)} | {s.help} |")
    return "\n".join(rows)


def resolve_model(value: str | None, prog: str = "phaseserve", cache: str | None = None) -> ResolvedModel:
    """A --model value (or None: the default model) -> its folder and served name; a clear exit if none."""
    try:
        return model_source.resolve_model(value, cache=cache)
    except model_source.ModelNotFound as e:
        raise SystemExit(f"{prog}: {e}") from None


if __name__ == "__main__":
    print(markdown_table())
