"""The training loop's bookkeeping, so that train.py's loop reads batch → forward → backward →
step → log/eval/save: what the metrics window has summed, the clocks, and the decisions to
log, evaluate, save and stop, taken alike on every rank.

Clocks: `wall_s` is the run's wall time and `trained_s` the same with evaluations left out
(the `elapsed_s` of the metrics, for time-to-accuracy plots); both continue across relaunches
(the checkpoint keeps them), and `--time-budget` is measured on `wall_s`, so a preempted and
relaunched run stops where one uninterrupted run would have.

`grad_norm` in the metrics is the L2 norm of the gradient averaged over ranks, without the loss
scale, before any clipping, at the logged step (train.py measures it; null where it was not
measured). On steps where the engine did not average the gradients and the ranks step on
their own (DiLoCo's every step; 0/1 Adam's 1-bit and local steps, not its variance steps) it is
the root mean square of the ranks' own gradient norms, summed in the row's allreduce: averaging
the whole gradient only to log it would send as much as a sync. Under 0/1 Adam's variance stage
the logged series therefore alternates between the two."""
from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commodity_bert.data.loader import DataError

WINDOW_KEYS = ("loss", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "real_tokens")


def agree(flags: list[bool], device) -> list[bool]:
    """Every rank takes the same decision: any rank's flag counts."""
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def sum_across_ranks(values: dict, device) -> dict:
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


@dataclass
class Decision:
    log: bool
    evaluate: bool
    save: bool
    stop: str | None  # why the loop ends after this step: "signal", "time budget", "max steps", "error"


class Bookkeeping:
    def __init__(self, *, device, world: int, total_batch: int, max_steps: int, log_every: int,
                 eval_every: int, save_every: int, save_every_minutes: float, time_budget: float | None,
                 traffic, nodes: int = 1, clocks: dict | None = None):
        self.device, self.world, self.total_batch = device, world, total_batch
        self.max_steps, self.log_every, self.eval_every = max_steps, log_every, eval_every
        self.save_every, self.save_every_minutes, self.time_budget = save_every, save_every_minutes, time_budget
        self.traffic = traffic  # a BytesCounter: this rank's bytes and collective calls so far
        self.nodes = nodes  # how many nodes the ranks are on: node_bytes_* are per node
        clocks = clocks or {}
        self.wall_before, self.trained_before = clocks.get("wall_s", 0.0), clocks.get("trained_s", 0.0)
        self.started = self.last_save = time.time()
        self.evaluating = 0.0  # seconds spent scoring the held-out set in this launch
        self._flags_in_flight = None  # (work, flags): the last step's signal/clock/error flags, being agreed
        self.error: str | None = None  # this rank's own error mid-run, held until every rank knows it
        self._last_batch = None
        self.window = torch.zeros(len(WINDOW_KEYS), dtype=torch.float64, device=device)
        self._reset_window()

    # ---- clocks
    def wall_s(self) -> float:
        return self.wall_before + time.time() - self.started

    def trained_s(self) -> float:
        return self.trained_before + time.time() - self.started - self.evaluating

    def clocks(self) -> dict:
        return {"wall_s": self.wall_s(), "trained_s": self.trained_s()}

    # ---- the window
    def _reset_window(self) -> None:
        self.window.zero_()
        self.flops, self.micro_batches, self.steps, self.data_wait = 0.0, 0, 0, 0.0
        self.grad_norm: torch.Tensor | None = None
        self.grad_norm_per_rank = False  # grad_norm is this rank's own (see the module's docstring)
        self.unlogged_traffic = dict.fromkeys(self.traffic.FIELDS, 0)  # the loop's own collectives
        self.window_started, self.evaluating_at_start = time.time(), self.evaluating
        self.traffic_at_start = self.traffic.snapshot()

    def next_batch(self, batches):
        """The next micro-batch; where this rank's data fails (a shard changed on disk), the error
        is held and the last batch stands in, so that the step's collectives still meet until every
        rank has learnt of it (the run then stops without saving that step)."""
        waited = time.perf_counter()
        if self.error is None:
            try:
                self._last_batch = next(batches)
            except DataError as exc:
                if self._last_batch is None:  # nothing to stand in: the first batch
                    raise
                self.hold_error(str(exc))
        self.data_wait += time.perf_counter() - waited
        return self._last_batch

    # ---- one rank's error, mid-run
    def hold_error(self, line: str) -> None:
        """An error this rank met mid-run, held to the next decision, where every rank learns it
        from the allreduce that already carries a signal: all stop together, and the others say
        which rank stopped and why instead of having "lost a peer" when it exits. It travels with
        the collectives, so nodes need share no directory for it."""
        self.error = self.error or line

    @contextlib.contextmanager
    def holding(self, *errors: type[BaseException], what: str = ""):
        """Errors of these kinds raised inside are held (hold_error), not raised."""
        try:
            yield
        except errors as exc:
            self.hold_error(f"{what}{exc}")

    def any_error(self) -> bool:
        """Whether any rank holds an error now (a blocking allreduce: before a save or the export)."""
        flag = torch.tensor([float(self.error is not None)], device=self.device)
        with self.unlogged():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def error_lines(self, step: int) -> list[str]:
        """Collective, once some rank holds an error: what this rank says. The rank that met it says
        its line; the first of the others names that rank, its host and its line."""
        views = [None] * self.world
        with self.unlogged():
            dist.all_gather_object(views, (socket.gethostname(), self.error))
        rank = dist.get_rank()
        failed = [(r, host, line) for r, (host, line) in enumerate(views) if line]
        if self.error:
            return [f"train.py: error: {self.error}"]
        if rank != next(r for r in range(self.world) if not views[r][1]):
            return []
        r, host, line = failed[0]
        return [(f"train.py: error: rank {r} on {host} stopped with an error after step {step} (its line, in "
                 f"{host}'s output: {line}); every rank stopped with it, no checkpoint written after the error")]

    def add_micro_batch(self, loss: torch.Tensor, stats: dict, real_tokens: torch.Tensor, flops: float) -> None:
        # summed on the device and read once per log step: no host sync per micro-batch
        stats = {**stats, "loss": loss.detach(), "real_tokens": real_tokens}
        self.window += torch.stack([stats[k].double() if k in stats else self.window.new_zeros(())
                                    for k in WINDOW_KEYS])
        self.flops += flops
        self.micro_batches += 1

    def end_step(self, grad_norm, per_rank: bool = False) -> None:
        self.steps += 1
        self.grad_norm, self.grad_norm_per_rank = grad_norm, per_rank and grad_norm is not None

    @contextlib.contextmanager
    def unlogged(self):
        """Collectives inside are the loop's own (decisions, gradient norm, evaluation, saving),
        left out of `bytes_sent`, `bytes_received`, `node_bytes_*` and `comm_rounds`, which describe
        training's traffic."""
        before = self.traffic.snapshot(this_thread=True)  # not an exchange running beside the loop
        try:
            yield
        finally:
            for field, value in self.traffic.snapshot(this_thread=True).items():
                self.unlogged_traffic[field] += value - before[field]

    # ---- decisions
    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step >= self.max_steps

    def decide(self, step: int, signalled: bool) -> Decision:
        """What to do after this step, alike on every rank.

        What counts steps (max steps, --save-every, logging, evaluation) every rank knows without
        asking. What one rank alone may see (a signal, its clock for --time-budget and
        --save-every-minutes) is agreed by one small allreduce that runs while the next step
        computes: raised at step t, it acts at step t + 1 on every rank. A blocking allreduce at
        every step cost a network round trip per step, which over a slow link is what DiLoCo and
        local steps exist to save."""
        agreed = [False, False, False, False]
        if self._flags_in_flight is not None:
            work, flags = self._flags_in_flight
            with self.unlogged():
                work.wait()
            agreed = [bool(v) for v in flags.tolist()]
            self._flags_in_flight = None
        signal_agreed, out_of_time, minutes_due, error = agreed
        if error:  # no save: some rank's state since its error is not the training's
            return Decision(log=False, evaluate=False, save=False, stop="error")
        stop = "signal" if signal_agreed else "time budget" if out_of_time else "max steps" \
            if step >= self.max_steps else None
        save = bool(self.save_every and step % self.save_every == 0) or minutes_due or stop is not None
        if stop is None:
            due = not save and bool(self.save_every_minutes) and \
                time.time() - self.last_save >= self.save_every_minutes * 60
            budget = self.time_budget is not None and self.wall_s() >= self.time_budget
            flags = torch.tensor([float(signalled), float(budget), float(due), float(self.error is not None)],
                                 device=self.device)
            with self.unlogged():
                self._flags_in_flight = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), flags)
        return Decision(log=self.is_log_step(step) or stop is not None,
                        evaluate=bool(self.eval_every and step % self.eval_every == 0) or stop is not None,
                        save=save, stop=stop)

    def saved(self) -> None:
        self.last_save = time.time()

    # ---- what gets logged
    def evaluate(self, score) -> dict:
        started = time.time()
        with self.unlogged():
            result = score()
        self.evaluating += time.time() - started
        return result

    def row(self, step: int, samples: int, lr: float, loss_scale: float) -> dict:
        """The window's metrics (collectives: call on every rank), then a fresh window."""
        traffic = {field: (value - self.traffic_at_start[field] - self.unlogged_traffic[field]) / self.steps
                   for field, value in self.traffic.snapshot().items()}
        dist.all_reduce(self.window)
        totals = dict(zip(WINDOW_KEYS, self.window.tolist()))
        # micro-batches too: ranks of unequal speed train unequal numbers of them (train/balance.py)
        sums = {"flops": self.flops, "micro_batches": self.micro_batches,
                "between_sent": traffic.pop("bytes_sent_between_nodes"),
                "between_received": traffic.pop("bytes_received_between_nodes")}
        if self.grad_norm_per_rank:  # alike on every rank: the same path measured the same step
            sums["grad_norm_sq"] = float(self.grad_norm) ** 2
        sums = sum_across_ranks(sums, self.device)
        total_flops = sums["flops"]
        grad_norm = None if self.grad_norm is None else float(self.grad_norm)
        if self.grad_norm_per_rank:
            grad_norm = (sums["grad_norm_sq"] / self.world) ** 0.5
        seconds = time.time() - self.window_started - (self.evaluating - self.evaluating_at_start)
        row = {"step": step, "samples": samples, "elapsed_s": self.trained_s(),
               "loss": totals["loss"] / sums["micro_batches"],
               "mlm_acc": totals["mlm_correct"] / max(totals["mlm_count"], 1),
               "lr": lr, "loss_scale": loss_scale,
               "grad_norm": grad_norm,
               "seq_per_s": self.steps * self.total_batch / seconds,
               "tokens_per_s": totals["real_tokens"] / seconds,
               "tflops": total_flops / seconds / 1e12,
               "data_wait_s": self.data_wait / self.steps,
               **traffic,
               # what a node's link carries: its ranks' bytes to and from other nodes, mean over nodes
               "node_bytes_sent": sums["between_sent"] / self.nodes,
               "node_bytes_received": sums["between_received"] / self.nodes}
        if totals["nsp_count"]:
            row["nsp_acc"] = totals["nsp_correct"] / totals["nsp_count"]
        self._reset_window()  # after the row's own collectives: they are not the next window's
        return row
