"""A disaggregated cluster on this machine: prefill vLLM(s) + decode vLLM(s) + ``hawk proxy``
(+ vLLM's router).

Used by ``hawk bench serve``, the end-to-end tests and ``examples/pd_local/run_demo.py``. Every server runs
in its own session (process group), so :meth:`LocalCluster.stop` ends it and every
process vLLM spawned (engine core, worker) with one signal, and checks none is left.

    with LocalCluster(model_dir, workdir) as c:   # starts, waits for /health
        requests.post(c.proxy_url + "/v1/completions", ...)

Authentication is on as in a deployment: :meth:`LocalCluster.start` writes a fresh random
secret to ``<workdir>/shared_secret`` (mode 0600) and gives both servers
``auth``/``shared_secret_file`` (``auth="none"`` runs without; ``extra_config`` may
override either).

The paper's four serving configurations (:data:`CONFIGURATIONS`: ``GG-Host``,
``GG-Direct``, ``GN-Host``, ``GN-HAWK``) start the same way, with the same interface:

    with LocalCluster.configured("GN-Host", model_dir, workdir, dtype="bfloat16") as c:

Several prefills and decodes (``prefills``/``decodes``; the proxy fronts all of them) and
vLLM's router (``vllm-router --vllm-pd-disaggregation``) over any subset of them
(``routers``: name -> (prefill indices, decode indices)), for xPyD behind either front:

    LocalCluster.configured("GG-Direct", m, w, prefills=2, decodes=2,
                            routers={"2p1d": ((0, 1), (0,)), "1p2d": ((0,), (0, 1))})
    c.router_url("2p1d")

The proxy sends every request P/D (``proxy_args``: decode-first serving off), as the
tests and the benchmark's P/D rows need; :meth:`LocalCluster.add_proxy` starts another
``hawk proxy`` over the same engines with other flags (decode-first on, for one):

    url = c.add_proxy("decode-first", [])   # hawk proxy's defaults

On machines with 2+ CPUs the prefill's model threads are bound to the first CPU and the
decode's to the second (``VLLM_CPU_OMP_THREADS_BIND``); vLLM's default binds both to the
same core.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: ``hawk proxy`` flags that send every request through a prefill (decode-first serving off)
PD_ONLY_PROXY_ARGS = ("--local-prefill-max-tokens", "0", "--local-prefill-min-cached", "0")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

Progress = Callable[[str, float], None]  # (what is starting, seconds so far)

#: The paper's serving configurations as :class:`LocalCluster` settings: each names its
#: connector ``pair`` (:data:`vllm_hawk.connector.config.PAIRS`). GG: a vLLM decode; GN: a
#: decode on the emulated Tenstorrent platform plugin (``decode_tt``, which also sets
#: ``device_profile``). ``hawk bench serve`` runs every entry, so a configuration added here
#: is benchmarked too.
CONFIGURATIONS: dict[str, dict] = {
    "GG-Host": {"extra_config": {"pair": "gg-host"}},
    "GG-Direct": {"extra_config": {"pair": "gg-direct"}},
    "GN-Host": {"extra_config": {"pair": "gn-host"}, "tt": True},
    "GN-HAWK": {"extra_config": {"pair": "gn-hawk"}, "tt": True},
}


def free_port() -> int:
    """A port free right now, for components that cannot bind port 0 and report it back:
    vLLM's API server, and the connector's side channel (the scheduler advertises its port
    in ``kv_transfer_params`` before the worker binds). Everything else binds port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIDE_CHANNEL_PORTS = (20000, 32000)  # below Linux's ephemeral range (32768-60999) and Mooncake's 15xxx-16xxx


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive ports free right now (a TP prefill's side channels:
    rank r listens on port + r). Taken from :data:`SIDE_CHANNEL_PORTS`, outside the
    ephemeral range: the ranks bind tens of seconds later, and an ephemeral port picked
    here was taken in between by another process's outgoing connection (a CI run failed
    with "Address already in use" on rank 1's port)."""
    import random

    for _ in range(200):
        base = random.randrange(SIDE_CHANNEL_PORTS[0], SIDE_CHANNEL_PORTS[1] - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def remove_vllm_shm() -> list[str]:
    """vLLM 0.32's CPU build leaves ``/dev/shm/vllm_dist_*cpushm*`` files behind at every
    shutdown of a tensor-parallel engine; remove those no process holds open."""
    import glob

    held = set()
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            continue
    removed = []
    for f in glob.glob("/dev/shm/vllm_dist_*cpushm*"):
        if f not in held:
            with contextlib.suppress(OSError):
                os.unlink(f)
                removed.append(f)
    return removed


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape_metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` of a vLLM server: value per metric name, summed over label sets."""
    _, raw = http_get(base_url + "/metrics", timeout=10)
    out: dict[str, float] = {}
    for line in raw.decode(errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    url: str
    proc: subprocess.Popen | None = None
    pgid: int = 0  # kept after stop(), to check that nothing of the group is left
    #: stop() signals the server process alone first and lets it stop its engine (vLLM's own
    #: shutdown: one SIGTERM to the engine core, then a grace period); a second SIGTERM that
    #: reaches the engine core during its teardown kills it before its worker shut down
    graceful: bool = False
    _log: object = None

    def start(self) -> None:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the server writes it until stop() closes it
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        self.pgid = self.proc.pid

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-nbytes:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            if self.graceful:
                p.send_signal(signal.SIGTERM)
            else:
                _signal_group(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        _signal_group(p.pid, signal.SIGKILL)  # stragglers (engine core, worker)
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _group_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._log is not None:
            self._log.close()
        self.proc = None


def _name(role: str, i: int) -> str:
    """Server name of the ``i``-th prefill or decode: ``prefill``, ``prefill-1``, ..."""
    return role if i == 0 else f"{role}-{i}"


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


#: Environment of a tensor-parallel server on these 2-core machines: vLLM's default binding
#: refuses 2 ranks on one NUMA node, and pinning 2 ranks of each server to the 2 cores starved
#: the side channel for tens of seconds (a rank's main thread busy-polls vLLM's shared-memory
#: queue on its core); so ranks are unpinned, one OpenMP thread each.
TP_RANK_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def _proxy_auth(p_cfg: dict) -> list[str]:
    """``hawk proxy``'s auth flags for prefills configured with ``p_cfg``: their ``auth`` and
    secret file, so that it can release the KV of a request a decode refused."""
    secret = ["--shared-secret-file", p_cfg["shared_secret_file"]] if p_cfg.get("shared_secret_file") else []
    return ["--side-channel-auth", p_cfg.get("auth", "curve"), *secret]


def server_env(cpu: str | None, extra: dict, own: dict, tt_dir: str | None) -> dict[str, str]:
    """A server's environment: this one's, the cluster's ``extra`` and the role's ``own`` (a
    PYTHONPATH there goes after the rest), ``cpu`` its OpenMP binding (``nobind``: a TP rank),
    ``tt_dir`` the Tenstorrent decode's entry points."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("VLLM_TARGET_DEVICE", None)
    for k in [k for k in env if k.startswith("HAWK_TT_") or k.startswith("HAWK_SHARED_SECRET")]:
        env.pop(k)  # only the --tt-* flags choose the platform; only _auth_config the secret
    own = {k: str(v) for k, v in own.items()}
    env.update({k: str(v) for k, v in extra.items()}, **{k: v for k, v in own.items() if k != "PYTHONPATH"})
    if cpu == "nobind":
        env.update(TP_RANK_ENV)
    elif cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, tt_dir, env.get("PYTHONPATH"), own.get("PYTHONPATH")) if p)
    return env


@dataclass
class LocalCluster:
    """Prefill and decode servers (one of each by default), the proxy over all of them, and
    any vLLM routers named in ``routers`` (ports picked at start). Servers are named
    ``prefill``, ``prefill-1``, ... and ``decode``, ``decode-1``, ...; routers
    ``router-NAME``."""

    model: str | os.PathLike
    workdir: str | os.PathLike
    dtype: str = "float32"
    block_size: int = 32
    decode_block_size: int | None = None  # the decode's --block-size when it differs (GN-HAWK regroups)
    max_model_len: int = 1024
    max_num_seqs: int = 8
    extra_config: dict = field(default_factory=dict)  # both sides
    prefill_config: dict = field(default_factory=dict)
    decode_config: dict = field(default_factory=dict)
    decode_policy: str = "fail"  # kv_load_failure_policy
    #: GN-HAWK: run the decode on the emulated Tenstorrent platform plugin, e.g.
    #: ``{"device": "p150a", "kv_dtype": "bfloat16"}`` (sets ``device_profile`` too; ``"chips": 2``
    #: shards the KV heads over a mesh of 2 chips, ``HAWK_TT_CHIPS``)
    decode_tt: dict | None = None
    #: a decode on vllm-tt-plugin with the HAWK decode worker (vLLM 0.25.1, another Python):
    #: ``{"python": PATH, "env": {...}, "device": "p150a", "kv_dtype": "bfloat16"|"bfloat8_b"}``;
    #: ``env`` adds the device's variables (the simulator's, ``EXTRA_MODELS_DIR``), the KV
    #: dtype picks tt_transformers' precision setting (``accuracy``: bfloat16, else bfloat8_b)
    decode_tt_plugin: dict | None = None
    extra_args: list = field(default_factory=list)  # vLLM CLI args for both servers
    extra_env: dict = field(default_factory=dict)  # environment of both servers
    prefill_env: dict = field(default_factory=dict)  # the prefill servers' only (PYTHONPATH: added last)
    decode_env: dict = field(default_factory=dict)  # the decode servers' only, likewise
    auth: str = "curve"  # side-channel authentication of both servers (a fresh secret file unless "none")
    startup_timeout_s: float = 400.0
    prefill_tp: int = 1  # --tensor-parallel-size of each side (ranks bind both CPUs: VLLM_CPU_OMP_THREADS_BIND 0|1)
    decode_tp: int = 1
    prefills: int = 1  # prefill servers (each its own side-channel ports)
    decodes: int = 1  # decode servers
    #: vLLM routers to start in PD mode: name -> (prefill indices, decode indices); round robin
    routers: dict = field(default_factory=dict)
    #: the proxy's upstreams: (prefill indices, decode indices); empty = all of them
    proxy_over: tuple = ()
    #: the proxy's own flags (default: decode-first serving off, every request P/D)
    proxy_args: tuple = PD_ONLY_PROXY_ARGS
    python: str = sys.executable
    servers: dict[str, Server] = field(default_factory=dict)

    @classmethod
    def configured(
        cls,
        name: str,
        model: str | os.PathLike,
        workdir: str | os.PathLike,
        *,
        device: str = "p150a",
        kv_dtype: str = "bfloat16",
        **kw,
    ) -> LocalCluster:
        """A cluster for configuration ``name`` of :data:`CONFIGURATIONS` (not started).
        ``device``/``kv_dtype``: the Tenstorrent decode of the GN configurations; other
        keyword arguments are :class:`LocalCluster` fields (``extra_config`` is merged
        over the configuration's)."""
        if name not in CONFIGURATIONS:
            raise ValueError(f"configuration must be one of {sorted(CONFIGURATIONS)}, got {name!r}")
        conf = CONFIGURATIONS[name]
        kw["extra_config"] = {**conf["extra_config"], **kw.get("extra_config", {})}
        if conf.get("tt"):
            kw.setdefault("decode_tt", {"device": device, "kv_dtype": kv_dtype})
        return cls(model, workdir, **kw)

    # ---------------------------------------------------------------- urls
    @property
    def prefill_url(self) -> str:
        return self.servers["prefill"].url

    @property
    def decode_url(self) -> str:
        return self.servers["decode"].url

    @property
    def prefill_urls(self) -> list[str]:
        return [self.servers[_name("prefill", i)].url for i in range(self.prefills)]

    @property
    def decode_urls(self) -> list[str]:
        return [self.servers[_name("decode", i)].url for i in range(self.decodes)]

    @property
    def proxy_url(self) -> str:
        return self.servers["proxy"].url

    def router_url(self, name: str) -> str:
        """The URL of router ``name`` of :attr:`routers`."""
        return self.servers[f"router-{name}"].url

    # ---------------------------------------------------------------- lifecycle
    def _tt_entry_point_dir(self) -> str | None:
        """Where a metadata-only ``.dist-info`` declares the Tenstorrent platform entry
        point, so every process vLLM spawns sees the plugin (None: installed already)."""
        from vllm_hawk.tenstorrent.emulated import entry_point_path

        saved = os.environ.get("PYTHONPATH")
        try:
            return entry_point_path(Path(self.workdir) / "tt_entry_point")
        finally:  # only the decode server's environment gets it (see _env)
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved

    def _env(self, cpu: str | None, tt: bool = False, own: dict | None = None) -> dict[str, str]:
        return server_env(cpu, self.extra_env, own or {}, self._tt_entry_point_dir() if tt else None)

    def _vllm(self, role: str, kv_role: str, config: dict, cpu: str | None, name: str = "") -> Server:
        work = Path(self.workdir)
        tp = self.prefill_tp if role == "prefill" else self.decode_tp
        tp_args = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        if tp > 1:  # TP_RANK_ENV: ranks unpinned, one OpenMP thread each
            cpu = "nobind"
        port = free_port()
        ktc = {
            "kv_connector": "HawkConnector",
            "kv_connector_module_path": "vllm_hawk.connector",
            "kv_role": kv_role,
            "kv_connector_extra_config": config,
        }
        if kv_role == "kv_consumer":
            ktc["kv_load_failure_policy"] = self.decode_policy
        launcher = ["-m", "vllm_hawk.vllm_launcher"]
        python = self.python
        if role == "decode" and self.decode_tt_plugin:
            python, launcher = self.decode_tt_plugin["python"], ["-m", "vllm.entrypoints.cli.main"]
        elif role == "decode" and self.decode_tt:
            launcher = [
                "-m",
                "vllm_hawk.vllm_launcher",
                "--tt-platform",
                "emulated",  # the device: the connector's device_profile (named once)
                "--tt-kv-dtype",
                self.decode_tt.get("kv_dtype", "bfloat16"),
                *(["--tt-chips", str(self.decode_tt["chips"])] if self.decode_tt.get("chips") else []),
            ]
        argv = [
            python,
            *launcher,
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--enforce-eager",
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.decode_block_size if role == "decode" and self.decode_block_size else self.block_size),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--chat-template",
            str(work / "chat_template.jinja"),
            *tp_args,
            *map(str, self.extra_args),
            "--kv-transfer-config",
            json.dumps(ktc),
        ]
        tt = role == "decode" and bool(self.decode_tt)
        name = name or role
        env = self._env(cpu, tt, self.decode_env if role == "decode" else self.prefill_env)
        graceful = role == "decode" and bool(self.decode_tt_plugin)
        if graceful:
            argv += self._tt_plugin_args()
            env.update(self.decode_tt_plugin.get("env", {}))
        return Server(name, argv, env, work / f"{name}.log", f"http://127.0.0.1:{port}", graceful=graceful)

    def _tt_plugin_args(self) -> list[str]:
        """vLLM flags of a decode on vllm-tt-plugin: the HAWK worker, and the plugin's
        ``tt`` settings (the KV dtype through tt_transformers' precision setting)."""
        from vllm_hawk.tenstorrent.vllm_tt import WORKER_CLS

        bf16 = self.decode_tt_plugin.get("kv_dtype", "bfloat8_b") == "bfloat16"
        tt = {"optimizations": "accuracy" if bf16 else "performance", "trace_mode": "none"}
        # --shutdown-timeout: vLLM 0.25.1's default (0) kills the engine core at once, before
        # its worker can stop the connector and close the mesh
        return [
            "--worker-cls",
            WORKER_CLS,
            "--additional-config",
            json.dumps({"tt": tt}),
            "--shutdown-timeout",
            "10",
        ]

    def start(self, progress: Progress | None = None) -> LocalCluster:
        work = Path(self.workdir)
        work.mkdir(parents=True, exist_ok=True)
        (work / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        p_cpu, d_cpu = (str(cpus[0]), str(cpus[1])) if len(cpus) >= 2 else (None, None)
        tt_decode = self.decode_tt or self.decode_tt_plugin
        tt = {"device_profile": tt_decode.get("device", "p150a")} if tt_decode else {}
        tt.update(self._auth_config(work))
        p_cfg = {**tt, **self.extra_config, **self.prefill_config}
        d_cfg = {**tt, **self.extra_config, **self.decode_config}
        for i in range(self.prefills):
            cfg = {"side_channel_port": free_port_run(self.prefill_tp), **p_cfg}
            self.servers[_name("prefill", i)] = self._vllm("prefill", "kv_producer", cfg, p_cpu, _name("prefill", i))
        for i in range(self.decodes):
            self.servers[_name("decode", i)] = self._vllm("decode", "kv_consumer", d_cfg, d_cpu, _name("decode", i))
        engines = list(self.servers)
        try:
            for s in self.servers.values():
                s.start()
            self._wait(engines, progress)
            self._start_fronts(p_cfg, progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_fronts(self, p_cfg: dict, progress: Progress | None) -> None:
        """``hawk proxy`` over every prefill and decode, then the vLLM routers."""
        self._proxy_cfg = p_cfg
        self.servers["proxy"] = self._proxy("proxy", list(self.proxy_args))
        self.servers["proxy"].start()
        for name, (pre, dec) in self.routers.items():
            self.servers[f"router-{name}"] = self._router(
                name, [self.prefill_urls[i] for i in pre], [self.decode_urls[i] for i in dec]
            )
            self.servers[f"router-{name}"].start()
        self._wait(["proxy", *(f"router-{n}" for n in self.routers)], progress)

    def _proxy(self, name: str, args: list[str]) -> Server:
        """``hawk proxy`` over the upstreams of :attr:`proxy_over` (its port picked free)
        with the extra flags ``args``."""
        pre, dec = self.proxy_over or (range(self.prefills), range(self.decodes))
        ups = [a for i in pre for a in ("--prefill", self.prefill_urls[i])]
        ups += [a for i in dec for a in ("--decode", self.decode_urls[i])]
        port = free_port()
        argv = [self.python, "-m", "vllm_hawk.proxy", *ups, "--port", str(port), *_proxy_auth(self._proxy_cfg), *args]
        return Server(name, argv, self._env(None), Path(self.workdir) / f"{name}.log", f"http://127.0.0.1:{port}")

    def add_proxy(self, name: str, args: list[str]) -> str:
        """Start one more ``hawk proxy`` over the running cluster's engines with ``args``, not
        :attr:`proxy_args` (server ``proxy-NAME``, stopped with the cluster); its URL."""
        key = f"proxy-{name}"
        if key in self.servers:
            raise ValueError(f"proxy {name!r} is running already")
        self.servers[key] = self._proxy(key, args)
        self.servers[key].start()
        self._wait([key], None)
        return self.servers[key].url

    def _router(self, name: str, prefill: list[str], decode: list[str]) -> Server:
        """vLLM's router in PD mode over ``prefill`` and ``decode`` (round robin over each;
        its Prometheus port picked free too, since several may run at once)."""
        port = free_port()
        argv = [
            self.python,
            "-m",
            "vllm_router.launch_router",
            "--vllm-pd-disaggregation",
            *(a for u in prefill for a in ("--prefill", u)),
            *(a for u in decode for a in ("--decode", u)),
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
        ]
        work = Path(self.workdir)
        return Server(f"router-{name}", argv, self._env(None), work / f"router-{name}.log", f"http://127.0.0.1:{port}")

    def _auth_config(self, work: Path) -> dict:
        """``auth`` and a fresh ``shared_secret_file`` (0600) for both servers."""
        if self.auth == "none":
            return {"auth": "none"}
        path = work / "shared_secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        os.chmod(path, 0o600)
        return {"auth": self.auth, "shared_secret_file": str(path)}

    def _wait(self, names: list[str], progress: Progress | None) -> None:
        t0 = time.monotonic()
        pending = list(names)
        while pending:
            elapsed = time.monotonic() - t0
            for name in list(pending):
                s = self.servers[name]
                if s.proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} server exited with code {s.proc.returncode}\n--- {s.log_path} ---\n{s.log_tail()}"
                    )
                try:
                    if http_get(s.url + "/health", timeout=2)[0] == 200:
                        pending.remove(name)
                except OSError:
                    pass
            if elapsed > self.startup_timeout_s:
                raise TimeoutError(
                    f"{pending} not healthy after {elapsed:.0f} s\n"
                    + "\n".join(self.servers[n].log_tail(2000) for n in pending)
                )
            if progress is not None and pending:
                progress(", ".join(pending), elapsed)
            if pending:
                time.sleep(1.0)

    def stop(self) -> None:
        fronts = [n for n in self.servers if n.startswith("proxy") or n.startswith("router-")]
        decodes = [n for n in self.servers if n.startswith("decode")]
        for name in (*fronts, *decodes, *(n for n in self.servers if n.startswith("prefill"))):
            self.servers[name].stop()
        if max(self.prefill_tp, self.decode_tp) > 1:
            remove_vllm_shm()

    def leftover_processes(self) -> list[int]:
        """Process groups of this cluster that still exist (should be empty after stop)."""
        return [s.pgid for s in self.servers.values() if s.pgid and _group_alive(s.pgid)]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
