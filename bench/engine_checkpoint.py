"""One benchmark run over several processes: `kubelora bench engine --checkpoint FILE [--stop-after S]`.

A device-machine call can be shorter than a whole run. With a checkpoint, the result so far and the names of
the finished stages (device rates, compiled transformers, each engine, the HTTP server) are saved after every
stage; a process started again with the same file, the same settings and on the same machine (host name and
boot id) keeps them and runs the stages left. `--stop-after S`: no stage starts S seconds or more after the
process started, so a call's time limit does not cut a stage off; the process then exits with code 3. Settings or
a machine that differ from the checkpoint's are refused: their rows would not be one run.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kubelora.bench.engine_plan import EngineBenchConfig
from kubelora.bench.engine_report import BenchResult

UNFINISHED_EXIT = 3


def machine_id() -> str:
    """The host name and, where Linux has one, the boot id: another machine or a reboot is another run."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "-"
    return f"{socket.gethostname()}/{boot}"


class CheckpointMismatch(ValueError):
    pass


@dataclass
class Checkpoint:
    path: Path
    config: EngineBenchConfig
    stop_after_s: float | None = None
    result: BenchResult | None = None
    done: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def open(cls, path: Path, config: EngineBenchConfig, stop_after_s: float | None = None) -> Checkpoint:
        """The checkpoint at path (a new one where there is no file); CheckpointMismatch where its settings or its
        machine are not this process's."""
        checkpoint = cls(Path(path), config, stop_after_s)
        if not checkpoint.path.exists():
            return checkpoint
        with checkpoint.path.open("rb") as f:
            saved = pickle.load(f)
        if saved["config"] != asdict(config):
            changed = sorted(k for k, v in asdict(config).items() if saved["config"].get(k) != v)
            raise CheckpointMismatch(f"{path} holds a run with other settings ({', '.join(changed)}); "
                                     "remove it to start a new run")
        if saved["machine"] != machine_id():
            raise CheckpointMismatch(f"{path} holds a run of machine {saved['machine']}, this is {machine_id()}; "
                                     "remove it to start a new run")
        checkpoint.result, checkpoint.done = saved["result"], set(saved["done"])
        return checkpoint

    def is_out_of_time(self) -> bool:
        return self.stop_after_s is not None and time.perf_counter() - self.started >= self.stop_after_s

    def save(self, result: BenchResult) -> None:
        """Write the result and the finished stages (a new file moved over the old one: never half written)."""
        self.result = result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_name(self.path.name + ".tmp")
        with staging.open("wb") as f:
            pickle.dump({"config": asdict(self.config), "machine": machine_id(), "result": result,
                         "done": sorted(self.done)}, f)
        os.replace(staging, self.path)
