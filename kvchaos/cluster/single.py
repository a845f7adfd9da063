"""A non-disaggregated server of the same model and settings: the reference for differential checks."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from .api import ClusterAPI, Endpoints, wait_healthy
from .argv import LOOPBACK, engine_env, resolve_model, server_argv
from .ports import release_ports, reserve_ports
from .procs import ManagedProcess, leftover
from .reaper import Reaper
from .spec import ClusterSpec


class SingleServer(ClusterAPI):
    """A non-disaggregated server of the same model and settings: the reference for differential checks."""

    def __init__(self, spec: ClusterSpec, workdir, reaper: Reaper | None = None):
        self.spec, self.workdir = spec, Path(workdir)
        self.token = f"kvc-{os.getpid()}-{secrets.token_hex(4)}"
        self._own_reaper = reaper is None
        self.reaper = reaper
        self.proc: ManagedProcess | None = None
        self.ports: list[int] = []
        self.url: str | None = None

    def start(self) -> "SingleServer":
        try:
            if self.reaper is None:
                self.reaper = Reaper(self.token)
            (port,) = self.ports = reserve_ports(1)
            self.url = f"http://{LOOPBACK}:{port}"
            self.endpoints = Endpoints(router=self.url, prefill=self.url, decode=self.url)
            self.proc = ManagedProcess("single", server_argv(self.spec, resolve_model(self.spec), "single", port),
                                       engine_env(self.spec), self.workdir / "logs" / "single.log", self.reaper, self.token)
            wait_healthy({"single": self.proc}, {"single": f"{self.url}/health"},
                         time.monotonic() + self.spec.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def check_alive(self) -> None:
        if self.proc and not self.proc.alive():
            raise self.proc.died_error("is no longer running")

    def stop(self) -> list[int]:
        left = []
        if self.proc:
            self.proc.stop()
            left = leftover([self.proc.pgid], self.token)
        release_ports(self.ports)
        self.ports = []
        if self._own_reaper and self.reaper is not None:
            self.reaper.close()
            self.reaper = None
        return left

    def log_paths(self) -> dict:
        return {"single": str(self.proc.log_path)} if self.proc else {}


# --------------------------------------------------------------------------- attach mode
