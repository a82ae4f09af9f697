"""docker-compose.yml checked statically (there is no Docker engine here): every
service a user would run exists, is health-checked, is wired to Redis through the
environment, and runs a command the CLI really has with flags it really accepts."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import pytest
import yaml

from phaseserve import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        return yaml.safe_load(f)


def service_env(svc: dict) -> dict[str, str]:
    """A service's environment as compose would pass it, `${VAR:-default}` taken at its default."""
    return {k: re.sub(r"\$\{[^:}]+:-([^}]*)\}", r"\1", str(v)) for k, v in svc["environment"].items()}


def phaseserve_services(compose: dict) -> dict:
    """The long-running phaseserve services (not the one-shot model-cache)."""
    return {n: s for n, s in compose["services"].items()
            if s["command"][0] == "phaseserve" and s.get("restart") != "no"}


def test_services_and_healthchecks(compose):
    services = compose["services"]
    assert {"redis", "gateway", "scheduler", "worker", "worker-gpu"} <= set(services)
    for name, svc in services.items():
        if svc.get("restart") == "no":  # a one-shot step others wait on (service_completed_successfully)
            continue
        assert "healthcheck" in svc, f"{name} has no healthcheck"
    for name, svc in phaseserve_services(compose).items():
        # each service's own check (not only "Redis answers"), run for real in the serving test below
        assert svc["healthcheck"]["test"][1:] == ["python", "-m", "phaseserve.healthcheck",
                                                  "worker" if name.startswith("worker") else name], name
    assert services["gateway"]["ports"], "gateway must publish its port"
    # the worker must be scalable: no fixed container name, no published port
    assert "container_name" not in services["worker"] and "ports" not in services["worker"]


def compose_command(text: str) -> str:
    """A command as compose runs it: `$$` is a literal `$` for the container's shell."""
    return text.replace("$$", "$")


SECRET_DIR = "/run/phaseserve"  # the redis-secret volume, where every service mounts it


def run_redis_secret(compose: dict, secrets_dir: Path, env: dict, yours: Path | None = None) -> Path:
    """The redis-secret service's command, run here with its volume at `secrets_dir` and the secret file
    compose mounts at `yours` (empty when not given): -> the password file."""
    sh, dash_c, script = compose["services"]["redis-secret"]["command"]
    assert (sh, dash_c) == ("sh", "-c")
    if yours is None:
        yours = secrets_dir.parent / f"{secrets_dir.name}-no-password"
        yours.write_text("")
    script = (compose_command(script).replace(SECRET_DIR, str(secrets_dir))
              .replace("/run/secrets/redis_password", str(yours)))
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=10)
    return secrets_dir / "redis_password"


def test_redis_secret_makes_a_private_password_once_or_takes_yours(compose, tmp_path):
    env = dict(os.environ)
    svc = compose["services"]["redis-secret"]
    # yours comes as a secret file (empty by default: generated instead), never through an environment,
    # which `docker inspect` shows
    assert "environment" not in svc and svc["secrets"] == ["redis_password"]
    assert compose["secrets"]["redis_password"]["file"] == "${REDIS_PASSWORD_FILE:-./docker/no-redis-password}"
    assert os.path.getsize(os.path.join(ROOT, "docker", "no-redis-password")) == 0
    first = run_redis_secret(compose, tmp_path, env).read_text()
    assert len(first) == 48 and all(c in "0123456789abcdef" for c in first), first
    assert (os.stat(tmp_path / "redis_password").st_mode & 0o777) == 0o600
    assert run_redis_secret(compose, tmp_path, env).read_text() == first  # kept
    other = tmp_path / "other"
    other.mkdir()
    assert run_redis_secret(compose, other, env).read_text() != first  # random
    mine = tmp_path / "mine"
    mine.write_text("mine\n")
    assert run_redis_secret(compose, tmp_path, env, yours=mine).read_text() == "mine"


def test_the_model_cache_is_filled_once_before_any_service_mounts_it(compose):
    """Docker copies an image's files into an empty named volume for each container that mounts it while it
    is empty; several at once raced (`failed to create symlink ... file exists`). The one-shot model-cache
    mounts it first and every service waits for it to complete."""
    services = compose["services"]
    one_shot = services["model-cache"]
    assert one_shot["restart"] == "no" and one_shot["command"] == ["phaseserve", "pull"]
    assert "phaseserve-cache:/cache" in one_shot["volumes"] and "depends_on" not in one_shot
    for name, svc in services.items():
        if "phaseserve-cache:/cache" in svc.get("volumes", ()) and name != "model-cache":
            assert svc["depends_on"]["model-cache"]["condition"] == "service_completed_successfully", name


def test_services_start_under_an_init_and_the_torch_index_is_a_build_arg(compose):
    for name, svc in compose["services"].items():
        if svc.get("image", "").startswith("phaseserve:"):
            assert svc["init"] is True, name  # SIGTERM reaches a worker in its first seconds too
    assert compose["services"]["worker"]["build"]["args"]["TORCH_INDEX"] == \
        "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        assert "pip install --index-url ${TORCH_INDEX} torch==2.13.0" in f.read()


def test_the_build_context_leaves_out_what_the_image_does_not_need():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignored = {line.strip().rstrip("/") for line in f if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", "runs", "bench/results", "**/__pycache__"} <= ignored


def test_the_redis_service_wants_a_password_and_refuses_dangerous_commands(compose, tmp_path):
    """The redis service's command and healthcheck, run here with a local redis-server and the password file
    redis-secret made: clients without the password are refused, CONFIG/SAVE are gone, and the password is on
    no command line and in no environment."""
    import time

    import redis as redis_py
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from phaseserve.redis_server import find_redis_server, free_port

    svc = compose["services"]["redis"]
    assert "ports" not in svc and "environment" not in svc
    assert svc["depends_on"]["redis-secret"]["condition"] == "service_completed_successfully"
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD"},
           "PATH": os.path.dirname(find_redis_server()) + os.pathsep + os.environ["PATH"]}
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    password = run_redis_secret(compose, secrets_dir, {**env, "REDIS_PASSWORD": ""}).read_text()
    port = free_port()
    sh, dash_c, script = svc["command"]
    assert (sh, dash_c) == ("sh", "-c")
    # the container has the port and /tmp alone
    script = (compose_command(script).replace("/tmp/redis.conf", str(tmp_path / "redis.conf"))
              .replace(SECRET_DIR, str(secrets_dir)))
    script += f" --port {port} --bind 127.0.0.1"
    proc = subprocess.Popen(["sh", "-c", script], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        client = redis_py.Redis(port=port, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("SAVE",), ("MODULE", "LIST"), ("DEBUG", "SLEEP", "0")):
            with pytest.raises(redis_py.ResponseError, match="unknown command"):
                client.execute_command(*command)
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:  # exec'd: the shell is now redis-server
            cmdline = f.read()
        assert b"redis-server" in cmdline and password.encode() not in cmdline
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            assert password.encode() not in f.read()
        assert (os.stat(tmp_path / "redis.conf").st_mode & 0o777) == 0o600
        # the healthcheck authenticates the same way (REDISCLI_AUTH, from the file)
        kind, check = svc["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        check = compose_command(check).replace("redis-cli", f"redis-cli -p {port}")
        assert subprocess.run(["sh", "-c", check.replace(SECRET_DIR, str(secrets_dir))], env=env,
                              timeout=10).returncode == 0
        wrong = tmp_path / "wrong"
        wrong.mkdir()
        (wrong / "redis_password").write_text("wrong")
        assert subprocess.run(["sh", "-c", check.replace(SECRET_DIR, str(wrong))], env=env,
                              timeout=10).returncode != 0
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_gpu_variant_reserves_a_device(compose):
    gpu = compose["services"]["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert gpu["environment"]["PHASESERVE_DEVICE"] == "cuda"


def test_environment_wiring(compose):
    known_env = {s.env for s in settings.SETTINGS}
    for name, svc in phaseserve_services(compose).items():
        env = svc["environment"]
        # the password comes from the file redis-secret made, in the volume each service mounts read-only
        assert env["REDIS_URL"] == "redis://redis:6379/0", name
        assert env["PHASESERVE_REDIS_PASSWORD_FILE"] == f"{SECRET_DIR}/redis_password", name
        assert f"redis-secret:{SECRET_DIR}:ro" in svc["volumes"], name
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        unknown = set(env) - known_env
        assert not unknown, f"{name} sets variables no setting reads: {unknown}"


def test_disaggregated_profile_runs_prefill_and_decode_workers(compose):
    """`docker compose --profile disaggregated up --scale worker=0`: prefill and decode workers, each
    scalable, each draining on SIGTERM within its stop grace period."""
    services = compose["services"]
    for name, role in (("worker-prefill", "prefill"), ("worker-decode", "decode")):
        svc = services[name]
        assert svc["profiles"] == ["disaggregated"], name
        args = svc["command"][2:]
        ns = settings.parse("worker", args)  # the role as the worker reads it
        assert ns.role == role and svc["command"][:2] == ["phaseserve", "worker"], name
        assert "container_name" not in svc and "ports" not in svc, f"{name} must be scalable"
        assert svc["environment"] == services["worker"]["environment"], name  # the same worker otherwise
        assert svc["healthcheck"] == services["worker"]["healthcheck"], name
    assert "profiles" not in services["worker"]  # the mixed worker stays the default layout


@pytest.mark.parametrize("service", ["worker", "worker-prefill", "worker-decode", "worker-gpu"])
def test_workers_have_time_to_drain_before_docker_kills_them(compose, service):
    """Docker sends SIGTERM, then SIGKILL after stop_grace_period (10 s by default): a draining worker needs
    its drain timeout and the margin it waits beyond it."""
    from phaseserve.workers.service import DRAIN_MARGIN_S

    svc = compose["services"][service]
    env = service_env(svc)
    drain = float(env.get("PHASESERVE_DRAIN_TIMEOUT", settings.BY_NAME["drain_timeout"].default))
    grace = re.fullmatch(r"(\d+)s", svc["stop_grace_period"])
    assert grace and int(grace.group(1)) >= drain + DRAIN_MARGIN_S, svc.get("stop_grace_period")


@pytest.mark.parametrize("service", ["gateway", "scheduler", "worker", "worker-gpu", "worker-prefill",
                                     "worker-decode"])
def test_commands_exist_in_cli(compose, service, tmp_path):
    command = compose["services"][service]["command"]
    sub, args = command[1], command[2:]
    # The flags parse with the service's own settings, with the compose environment applied (the password
    # file where redis-secret's volume would be)
    env = service_env(compose["services"][service])
    (tmp_path / "redis_password").write_text("pw\n")
    env["PHASESERVE_REDIS_PASSWORD_FILE"] = str(tmp_path / "redis_password")
    code = (
        "import sys; from phaseserve import settings; "
        f"ns = settings.parse({sub!r}, {args!r}); print(ns.redis_url)"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "redis://:pw@redis:6379/0"
    # without the file: a clear error naming the setting, not a traceback
    env["PHASESERVE_REDIS_PASSWORD_FILE"] = str(tmp_path / "missing")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--redis-password-file" in out.stderr and "Traceback" not in out.stderr
    # And the console script knows the subcommand.
    help_out = subprocess.run([sys.executable, "-m", "phaseserve.stack.cli", sub, "--help"],
                              capture_output=True, text=True, timeout=60)
    assert help_out.returncode == 0, help_out.stderr
    assert "usage" in help_out.stdout.lower()


def test_dockerfile_copies_every_package():
    """Every folder setup.py installs (phaseserve/ and the folders it maps into it), and setup.py itself."""
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        dockerfile = f.read()
    with open(os.path.join(ROOT, "setup.py")) as f:
        mapped = next(ast.literal_eval(node.value) for node in ast.walk(ast.parse(f.read()))
                      if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MAPPED")
    for folder in ("phaseserve", *mapped):
        assert f"COPY {folder} ./{folder}" in dockerfile, folder
    assert re.search(r"^COPY pyproject.toml setup.py ", dockerfile, re.M)
    # the services run away from the copied sources: from there `python -m phaseserve.workers.relay` would
    # import ./phaseserve (the shared folder alone) instead of the installed package
    workdirs = re.findall(r"^WORKDIR (\S+)", dockerfile, re.M)
    assert workdirs[-1] == "/" and dockerfile.index("WORKDIR /\n") > dockerfile.index("RUN pip install ."), workdirs
    assert "torch==2.13.0" in dockerfile


BUILD_OPS = "RUN python -m phaseserve.kernels.native"


def test_the_image_builds_on_any_cpu_compiling_only_the_ops_its_cpu_runs():
    """The build compiles the native ops the build host's CPU runs, and none elsewhere (arm64, an x86-64
    below every op's level): no step asserts that every op loads."""
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        dockerfile = f.read()
    run_lines = [line for line in dockerfile.splitlines() if line.startswith("RUN")]
    assert BUILD_OPS in run_lines
    assert not any("assert" in line or "names()" in line for line in run_lines), run_lines
    from phaseserve.kernels import cpu_isa, native

    for cap in ("baseline", "avx2"):  # what such a build host runs: the build succeeds, whatever it can build
        level = min(cap, cpu_isa.detected(), key=cpu_isa.LEVELS.index)
        expected = [op for op in native.names()
                    if cpu_isa.LEVELS.index(native.REQUIRES[op]) <= cpu_isa.LEVELS.index(level)]
        if native._unsupported_platform() is not None:
            expected = []
        out = subprocess.run([sys.executable, "-m", "phaseserve.kernels.native"], capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, PHASESERVE_CPU_ISA=cap, PYTHONPATH=ROOT), cwd="/")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"CPU level {level}; built {', '.join(expected) or 'none'} of" in out.stdout, out.stdout


def test_native_names_are_the_op_sources():
    import phaseserve.kernels.native as native

    assert {"decode_attention", "extend_attention", "quant_gemm", "bf16_gemm", "layer_ops"} <= set(native.names())


def test_compose_commands_serve_through_the_console_script(compose, redis_server, tmp_path):
    """What compose would run, run here: each service's exact command through the installed
    `phaseserve` console script, configured only by the compose environment (Redis and the model
    folder swapped for local ones, the published port for a free one)."""
    import shutil
    import signal

    from openai import OpenAI

    from e2e_stack import wait_for
    from phaseserve.redis_server import free_port

    # the console script installed beside this interpreter (the venv need not be activated)
    exe = os.path.join(os.path.dirname(sys.executable), "phaseserve")
    if not os.access(exe, os.X_OK):
        exe = shutil.which("phaseserve") or pytest.fail("the `phaseserve` console script is not installed")
    port = free_port()
    procs = []
    log = open(tmp_path / "compose.log", "wb")
    # the password as compose hands it over: in a file (redis-secret's), the URL without it
    parts = urlsplit(redis_server)
    (tmp_path / "redis_password").write_text(unquote(parts.password))
    url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    secret = {"REDIS_URL": url, "PHASESERVE_REDIS_PASSWORD_FILE": str(tmp_path / "redis_password")}
    try:
        for name in ("scheduler", "worker", "gateway"):
            svc = compose["services"][name]
            env = service_env(svc)
            assert env["PHASESERVE_MODEL"] == "SmolLM2-135M-Instruct"  # the default; the tests' model here:
            env.update(**secret, PHASESERVE_MODEL="bundled", PHASESERVE_CACHE_DIR=str(tmp_path),
                       PHASESERVE_KV_CACHE_MEMORY="64MiB", PHASESERVE_HEARTBEAT_INTERVAL="0.5",
                       PHASESERVE_KEY_PREFIX="cmp", PHASESERVE_PORT=str(port))
            argv = [exe] + [str(a) for a in svc["command"][1:]]
            if name == "gateway":
                argv = [a if a != "8000" else str(port) for a in argv]
            procs.append(subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=log))

        def healthy():
            try:
                import urllib.request
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200
            except OSError:
                return False

        assert wait_for(healthy, 120, 0.3), (tmp_path / "compose.log").read_text()[-4000:]
        # each service's compose healthcheck, under the stack's key prefix and port
        check_env = {**os.environ, **secret, "PHASESERVE_KEY_PREFIX": "cmp",
                     "PHASESERVE_PORT": str(port)}

        def check(service: str, env: dict) -> int:
            return subprocess.run([sys.executable, "-m", "phaseserve.healthcheck", service], env=env,
                                  capture_output=True, timeout=30).returncode

        assert wait_for(lambda: all(check(s, check_env) == 0 for s in ("gateway", "scheduler", "worker")), 30, 0.5)
        assert check("scheduler", {**check_env, "PHASESERVE_KEY_PREFIX": "other"}) == 1
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["bundled"]  # the alias, never a mount point
        chunks = list(client.chat.completions.create(
            model="bundled", messages=[{"role": "user", "content": "Explain os.path.join"}],
            max_tokens=8, temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip(), "no text streamed"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                assert p.wait(timeout=20) == 0, f"{p.args[1]} exited {p.returncode}"
            except subprocess.TimeoutExpired:
                p.kill()
                raise
        log.close()


# ----------------------------------------------------------------------------- the stack, built and served


def compose_cli() -> tuple[list[str] | None, str]:
    """The compose command (`docker compose`, else docker-compose v1) and why not when there is none."""
    if shutil.which("docker") is None:
        return None, "no docker client"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        return None, "no Docker daemon reachable (docker info failed)"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode == 0:
        return ["docker", "compose"], ""
    if shutil.which("docker-compose"):
        return ["docker-compose"], ""
    return None, "neither `docker compose` nor docker-compose is installed"


def _ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health/ready", timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


def _health(url: str) -> dict:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=3) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())
    except OSError:
        return {}


def test_the_compose_stack_builds_serves_scales_hands_over_and_leaves_nothing(tmp_path):
    """`up --build` on the default model, a chat completion, `--scale worker=2` with the new worker taking
    work (it reports its steps when scaled down again), the disaggregated profile handing sequences over
    (over Redis: containers are hosts of their own), and `down -v` leaving no container, volume or network."""
    import json
    import time

    from openai import OpenAI

    from e2e_reference import metric
    from e2e_stack import wait_for
    from phaseserve.redis_server import free_port

    cli, why = compose_cli()
    if cli is None:
        pytest.skip(f"the compose stack needs a Docker engine: {why}")
    project = f"pscomposetest{os.getpid()}"
    port = free_port()
    env = {**os.environ, "PHASESERVE_PORT": str(port), "PHASESERVE_NUM_THREADS": "1",
           "PHASESERVE_KV_CACHE_MEMORY": "256MiB", "COMPOSE_PROJECT_NAME": project}
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "compose.log", "ab")

    def compose(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        print(f"$ {' '.join(cli)} -p {project} {' '.join(args)}", flush=True)
        out = subprocess.run([*cli, "-p", project, *args], cwd=ROOT, env=env, capture_output=True, timeout=timeout)
        log.write(out.stdout + out.stderr)
        assert out.returncode == 0, (out.stdout + out.stderr).decode(errors="replace")[-4000:]
        return out

    def chat(client: OpenAI, text: str) -> str:
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=16, temperature=0,
                                               messages=[{"role": "user", "content": text}])
        return reply.choices[0].message.content

    def labelled(kind: str) -> list[str]:
        args = {"container": ["ps", "-a"], "volume": ["volume", "ls"], "network": ["network", "ls"]}[kind]
        out = subprocess.run(["docker", *args, "-q", "--filter", f"label=com.docker.compose.project={project}"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.split()

    started = time.monotonic()
    try:
        compose("up", "-d", "--build", timeout=3000)
        print(f"built and started in {time.monotonic() - started:.0f}s", flush=True)
        assert wait_for(lambda: _ready(url), 600, 2), compose("logs", "--tail", "50").stdout.decode()[-6000:]
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        answer = chat(client, "What is the capital of France?")
        print(f"chat completion: {answer!r}", flush=True)
        assert answer.strip()

        compose("up", "-d", "--scale", "worker=2")
        assert wait_for(lambda: _health(url).get("scheduler_workers") == 2, 600, 2), _health(url)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: chat(client, f"Count to {i + 3}."), range(16)))
        assert all(a.strip() for a in answers)
        # the new worker stopped (it drains) and its last line read: how many steps it ran
        (second,) = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}", "--filter",
             "label=com.docker.compose.service=worker", "--filter", "label=com.docker.compose.container-number=2"],
            capture_output=True, text=True, timeout=60).stdout.split()
        subprocess.run(["docker", "stop", "-t", "40", second], capture_output=True, timeout=120, check=True)
        out = subprocess.run(["docker", "logs", second], capture_output=True, text=True, timeout=60)
        steps = [json.loads(line)["steps"] for line in (out.stdout + out.stderr).splitlines()
                 if '"worker stopped"' in line and line.startswith("{")]
        print(f"the second worker ran {steps} steps", flush=True)
        assert steps and steps[0] > 0, "the second worker took no work"
        compose("up", "-d", "--scale", "worker=1")

        compose("--profile", "disaggregated", "up", "-d", "--scale", "worker=0")
        assert wait_for(lambda: _health(url).get("worker_roles") == {"prefill": 1, "decode": 1}
                        and _health(url).get("scheduler_workers") == 2, 600, 2), _health(url)
        texts = [chat(client, f"Name {n} colours.") for n in (2, 3, 4)]
        assert all(t.strip() for t in texts)
        assert wait_for(lambda: metric(url, "kv_handoff_received") >= 3, 30)
        handed = metric(url, 'kv_handoff_transport_bytes{transport="redis"}')
        print(f"disaggregated: {metric(url, 'kv_handoff_sequences'):.0f} sequences handed over, "
              f"{handed:.0f} KV bytes over Redis", flush=True)
        assert handed > 0
    finally:
        subprocess.run([*cli, "-p", project, "--profile", "disaggregated", "down", "-v", "--remove-orphans"],
                       cwd=ROOT, env=env, capture_output=True, timeout=600)
        log.close()
    left = {kind: labelled(kind) for kind in ("container", "volume", "network")}
    print(f"after down -v: {left}", flush=True)
    assert left == {"container": [], "volume": [], "network": []}
