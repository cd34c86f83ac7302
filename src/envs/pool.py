"""A pool of environment worker processes, one environment each, stepping a batch in parallel
(docs/environments.md#the-contract, "Worker pool"). A broken or silent worker is restarted and its result is an
error result: an episode's exception never ends the run (docs/method.md#one-iteration, step 4).
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

logger = logging.getLogger(__name__)

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS")


def _worker_main(conn: Connection, env_cfg: dict[str, Any]) -> None:
    """Worker process: build one environment, then answer (command, argument) messages until "close"/EOF.
    Replies: ("ready", pid) once built, or ("init_error", traceback); then per request ("ok", result); for an
    exception: ("bad_request", message) for a ValueError/TypeError of ``tasks``/``system_prompt`` (a caller mistake,
    raised to the caller), ("episode_error", message) for one of ``reset``/``step`` (that episode fails; the worker
    stays healthy), or ("error", traceback) for anything else (the worker is restarted).
    """
    # One thread for any BLAS/torch pool (spawn re-imports the parent's __main__, which may import torch first).
    for var in _THREAD_VARS:
        os.environ[var] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # No GPU: a library a simulator imports (bm25s imports JAX when present) would grab GPU memory in every worker.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    # Ctrl-C goes to the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import hydra.utils

        env = hydra.utils.instantiate(env_cfg)
    except BaseException as exc:
        cause = exc.__cause__ if exc.__cause__ is not None and type(exc).__name__ == "InstantiationException" else exc
        # a setting or data file the environment refuses (its own one-line message): no traceback to read
        refused = isinstance(cause, (ValueError, FileNotFoundError))
        conn.send(("init_error", " ".join(str(cause).split()) if refused else traceback.format_exc(), refused))
        return
    conn.send(("ready", os.getpid()))
    calls = {"reset": env.reset, "step": env.step, "tasks": env.tasks, "system_prompt": lambda _: env.system_prompt}
    try:
        while True:
            try:
                cmd, arg = conn.recv()
            except (EOFError, OSError):  # parent gone
                break
            if cmd == "close":
                break
            try:
                if cmd not in calls:
                    raise ValueError(f"unknown pool command {cmd!r}")
                reply = ("ok", calls[cmd](arg))
            except (ValueError, TypeError) as exc:
                kind = "episode_error" if cmd in ("reset", "step") else "bad_request"
                reply = (kind, f"{type(exc).__name__}: {exc}")
            except Exception:
                reply = ("error", traceback.format_exc())
            conn.send(reply)
    finally:
        env.close()


@dataclass
class _Worker:
    process: Any  # multiprocessing SpawnProcess
    conn: Connection
    ready: bool = False


def _plain_config(env_cfg: Any) -> dict[str, Any]:
    if not isinstance(env_cfg, Mapping):  # a DictConfig is a Mapping
        raise ValueError(f"env_cfg: expected a mapping with '_target_', got {type(env_cfg).__name__}")
    cfg = dict(env_cfg)
    if "_target_" not in cfg:
        raise ValueError(f"env_cfg: expected a '_target_' key (the environment class), got keys {sorted(cfg)}")
    return cfg


class EnvPool:
    """``num_workers`` environment processes built from ``env_cfg`` with ``hydra.utils.instantiate``.

    Args:
        env_cfg: environment config with ``_target_`` (dict or DictConfig), picklable once resolved.
        timeout_s: seconds a call may take per worker before that worker is killed and restarted.
        start_timeout_s: extra seconds for a worker still building its environment (JVM start).

    Calls take ``(worker_index, argument)`` pairs (each index at most once) and return results in that order, sent
    to all workers before any answer is read; a failed one is an error result (``info["error"]``; for ``step`` an
    ended step with reward NaN). A ValueError/TypeError of ``tasks``/``system_prompt`` is re-raised as ValueError.

    Raises:
        ValueError: bad config, worker count, or request list.
        RuntimeError: a worker cannot build its environment at construction/resize (message carries its
            traceback), or ``tasks``/``system_prompt`` fail.
    """

    def __init__(self, env_cfg: Any, num_workers: int, timeout_s: float = 120.0,
                 start_timeout_s: float = 300.0) -> None:
        self.env_cfg = _plain_config(env_cfg)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.num_restarts = 0
        # Not fork: the parent holds torch/BLAS threads and py4j sockets that a forked child would inherit.
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._closed = False
        self.resize(num_workers)
        status, payload = self._call("system_prompt", [(0, None)])[0]
        if status != "ok":
            self.close()
            raise RuntimeError(f"EnvPool: could not read the system prompt: {payload}")
        self.system_prompt: str = payload

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, by index."""
        return [w.process.pid for w in self._workers]

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child_conn, self.env_cfg), daemon=True,
                                    name="env-worker")
        process.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        return _Worker(process, parent_conn)

    @classmethod
    def _close_workers(cls, workers: list[_Worker]) -> None:
        """Ask every worker to close its environment, then stop each (10 s each to finish)."""
        for worker in workers:
            try:
                worker.conn.send(("close", None))
            except (OSError, ValueError):  # already gone
                pass
        for worker in workers:
            cls._stop(worker, wait=10)

    @staticmethod
    def _stop(worker: _Worker, wait: float = 0.0) -> None:
        """Join the worker for up to ``wait`` seconds, then kill it if it is still alive."""
        if wait > 0:
            worker.process.join(timeout=wait)
        if worker.process.is_alive():
            worker.process.kill()  # its JVM exits too: py4j starts it with --die-on-broken-pipe
            worker.process.join(timeout=10)
        worker.conn.close()

    def _restart(self, i: int, reason: str) -> None:
        last_line = reason.strip().splitlines()[-1] if reason.strip() else reason
        logger.warning("EnvPool: restarting worker %d (pid %s): %s", i, self._workers[i].process.pid, last_line)
        self._stop(self._workers[i])
        self._workers[i] = self._spawn()
        self.num_restarts += 1

    def resize(self, num_workers: int) -> None:
        """Grow (start workers and wait until their environments are built) or shrink (close the last ones). Raises
        RuntimeError, leaving the pool as it was, if a new worker cannot build its environment."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r}: expected an int ≥ 1")
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        self._close_workers(self._workers[num_workers:])
        del self._workers[num_workers:]
        first_new = len(self._workers)
        self._workers.extend(self._spawn() for _ in range(first_new, num_workers))
        deadline = time.monotonic() + self.start_timeout_s
        for i in range(first_new, num_workers):
            try:
                msg = self._recv(self._workers[i], deadline)
            except (EOFError, OSError) as exc:
                msg = ("init_error", f"worker exited before reporting ({exc!r})")
            if msg is None or msg[0] != "ready":
                detail = msg[1] if msg else f"no answer within {self.start_timeout_s:.0f} s"
                for worker in self._workers[first_new:]:
                    self._stop(worker)
                del self._workers[first_new:]
                what = f"EnvPool: worker {i} could not build its environment ({self.env_cfg['_target_']})"
                if msg is not None and msg[2:] == (True,):  # refused by the environment: its message is the answer
                    from src.utils.config_error import RunError

                    raise RunError(f"{what}: {detail}")
                raise RuntimeError(f"{what}:\n{detail}")
            self._workers[i].ready = True

    @staticmethod
    def _recv(worker: _Worker, deadline: float) -> tuple | None:
        """Next message, or None on timeout (a message already waiting is read after the deadline); raises
        EOFError/OSError when the worker is gone."""
        if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
            return None
        return worker.conn.recv()

    def _call(self, cmd: str, requests: list[tuple[int, Any]]) -> list[tuple[str, Any]]:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        indices = [i for i, _ in requests]
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < len(self._workers)]
        if bad:
            raise ValueError(f"worker indices {bad}: expected ints in 0..{len(self._workers) - 1}")
        if len(set(indices)) != len(indices):
            raise ValueError(f"worker indices {indices}: each worker may appear once per call")

        # Pickle all first: a bad argument must not leave workers with a request whose answer nobody reads.
        messages = [ForkingPickler.dumps((cmd, arg)) for _, arg in requests]
        results: list[tuple[str, Any] | None] = [None] * len(requests)
        start = time.monotonic()
        for k, (i, _) in enumerate(requests):
            try:
                self._workers[i].conn.send_bytes(messages[k])
            except (OSError, ValueError) as exc:  # broken pipe / closed connection: the worker is gone
                results[k] = ("error", f"worker {i}: could not send {cmd!r}: {exc!r}; restarted")
                self._restart(i, repr(exc))
        self._gather(cmd, requests, results, start)
        bad_requests = [f"worker {i}: {payload}" for (i, _), (status, payload) in zip(requests, results)
                        if status == "bad_request"]
        if bad_requests:
            raise ValueError(f"EnvPool.{cmd}: " + "; ".join(bad_requests))
        return results  # type: ignore[return-value]

    def _gather(self, cmd: str, requests: list[tuple[int, Any]], results: list, start: float) -> None:
        """Fill the missing results with the workers' answers as they arrive, each worker against its own deadline
        (``timeout_s`` from ``start``, or from its "ready"): a hung worker never makes another one late."""
        starts = {k: start for k, result in enumerate(results) if result is None}
        while starts:
            conns = {self._workers[requests[k][0]].conn: k for k in starts}
            limits = {k: self.timeout_s + (0.0 if self._workers[requests[k][0]].ready else self.start_timeout_s)
                      for k in starts}
            first_deadline = min(starts[k] + limits[k] for k in starts)
            readable = wait(list(conns), max(0.0, first_deadline - time.monotonic()))
            for conn, k in conns.items():
                i = requests[k][0]
                if conn in readable:
                    results[k] = self._read(i, cmd)
                    if results[k] is None:  # a restarted worker announcing itself before the answer
                        # Its start-up (a JVM: a minute on a busy machine) is not part of this call's timeout_s.
                        starts[k] = time.monotonic()
                        continue
                elif time.monotonic() < starts[k] + limits[k] or conn.poll(0):
                    continue  # not late, or its answer came in since: read on the next round
                else:
                    reason = f"worker {i} gave no answer to {cmd!r} within {limits[k]:.0f} s; killed and restarted"
                    self._restart(i, reason)
                    results[k] = ("error", reason)
                del starts[k]

    def _read(self, i: int, cmd: str) -> tuple[str, Any] | None:
        """Worker ``i``'s next message as a call result, or None for its "ready"."""
        worker = self._workers[i]
        try:
            kind, payload = worker.conn.recv()[:2]
        except (EOFError, OSError):
            worker.process.join(timeout=1)
            reason = f"worker {i} died during {cmd!r} (exit code {worker.process.exitcode}); restarted"
            self._restart(i, reason)
            return ("error", reason)
        if kind == "ready":
            worker.ready = True
            return None
        if kind == "episode_error":  # the environment refused this episode's input; the worker is healthy
            return ("error", f"worker {i} raised during {cmd!r}: {payload}")
        if kind in ("error", "init_error"):
            what = "raised" if kind == "error" else "could not build its environment"
            self._restart(i, payload)
            return ("error", f"worker {i} {what} during {cmd!r}; restarted:\n{payload}")
        return (kind, payload)

    def reset(self, requests: list[tuple[int, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
        """Reset worker ``i`` on task dict ``task`` for each ``(i, task)``; returns ``(observation, info)`` each."""
        out = []
        for (i, _), (status, payload) in zip(requests, self._call("reset", requests)):
            out.append(tuple(payload) if status == "ok" else ("", {"error": payload, "worker": i}))
        return out

    def step(self, requests: list[tuple[int, str]]) -> list[tuple[str, float, bool, bool, dict[str, Any]]]:
        """Step worker ``i`` with the raw policy text for each ``(i, response)``; returns the env's 5-tuples."""
        out = []
        for (i, _), (status, payload) in zip(requests, self._call("step", requests)):
            if status == "ok":
                out.append(tuple(payload))
            else:
                out.append(("", math.nan, True, False, {"error": payload, "worker": i, "score": math.nan,
                                                         "success": False, "won": False, "valid_action": False}))
        return out

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """The task instances of ``split``, as listed by worker 0's environment."""
        status, payload = self._call("tasks", [(0, split)])[0]
        if status != "ok":
            raise RuntimeError(f"EnvPool.tasks({split!r}) failed: {payload}")
        return payload

    def close(self) -> None:
        """Stop every worker (each closes its environment); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_workers(self._workers)
        self._workers = []

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            try:
                self.close()
            except Exception:  # interpreter shutdown: workers are daemons and go anyway
                pass
