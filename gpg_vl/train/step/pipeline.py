"""The sampling stage of a step, and the pipeline that runs it beside the learner (trainer.max_staleness = k).

The schedule is fixed by step number, never by timing: step n samples with the weights after step
max(0, n - 1 - k) (`sampling_version`). With k = 0 that is the weights after step n - 1, the synchronous run:
`SyncPipeline` samples each step in the learner's thread when the learner asks for it, exactly as the loop always
did. With k >= 1, `AsyncPipeline` runs the sampling stage on a thread of its own, on its own copy of the weights
(and of the model family, whose tokenizer is not shared across threads), synced by the schedule:

    learner:  | update 1 (batch 1, v0) | update 2 (batch 2, v0) | update 3 (batch 3, v1) | ...
    sampler:  | batch 1 (v0) | batch 2 (v0) | batch 3 (v1)     | batch 4 (v2)           | ...      (k = 1)

The sampler owns the whole stage of its step: rollouts, rewards, advantages, AGE's valid groups and threshold
resampling, all with the same weight version; it hands the learner a complete `SampledStep`. After each update the
learner snapshots its trainable weights (`learned`) and releases them to the sampler once the step is logged and
saved (`released`). The sampler draws its random numbers from a generator of its own (rollout/engine.py's
`thread_generator`: the learner's gradient checkpointing forks torch's global one), so the same seed gives the
same run.

Checkpoints regenerate what is in flight, never pickle it: a checkpoint after step s holds the sampler's state as
it began step s + 1 (the data stream's position, which the checkpoint saves as its data position, the sampler's
generator and counters) and the weights steps s + 1 .. s + k sample with (after steps s - k .. s - 1, as safetensors;
the checkpoint's own weights are s's). A resumed run samples those steps again from the same state with the same
weights: the same batches as the uninterrupted run. The learner keeps the k + 1 newest versions for this.

The pipeline owns staleness and the weight-version number: trainer.max_staleness is read here alone (`k`, and the
checks of `require_pipeline`), and an engine with its own weights (vLLM) is synced by the pipeline with the
number of the step its weights are the weights after (`Engine.sync(model, version)`): after each update at k = 0,
by the schedule at k >= 1, and at the start of a resumed run, so a resumed run numbers its versions, and seeds its
requests, as the uninterrupted run did.

On CPU the two sides share the cores: each gets half of torch's intra-op threads (at least one), set in both threads.

Under DDP every process runs a sampler for its share of the prompts, and AGE's counts stay global: the sampler's
collectives (global_counts, the server engine's sync outcome) run on a gloo process group of their own
(gpg_vl/distributed.py's `collectives_on`), so they never interleave with the learner's gradient all-reduce.
Every process's sampler generator is saved in checkpoints. DeepSpeed ZeRO-1/2 keep whole weights on every process
and run as DDP does. Under FSDP2 each process's sampler holds a whole copy of the model, taken before the learner's
was sharded (`Learner.whole_copy`), and the learner's snapshots are gathered whole from the shards (collective, in
the learner's thread, on every process at the same step). ZeRO-3 is refused (`require_pipeline`): transformers
loads its weights already partitioned, so no whole copy exists to take.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from gpg_vl.data.mixture import Mixture
from gpg_vl.data.samplers import group_pass_rates
from gpg_vl.distributed import collective_group, collectives_on
from gpg_vl.errors import UserError
from gpg_vl.models.weights import whole_tensor
from gpg_vl.reward.pool import RewardBudget
from gpg_vl.rollout.engine import ENGINES, build_engine, thread_generator
from gpg_vl.train.checkpoint.folder import latest_checkpoint
from gpg_vl.train.checkpoint.resume import load_in_flight, set_rng_state
from gpg_vl.train.checkpoint.save import rng_state
from gpg_vl.train.step.sample import (
    Collected,
    attempts_allowed,
    budget_spent,
    collect_valid_groups,
    global_counts,
    sample_attempt,
    sample_mixed_attempt,
    tokens_left,
)

SAMPLER_SEED_OFFSET = 1_000_003  # the sampler's generator: seed + process index + this


def sampling_version(step: int, max_staleness: int) -> int:
    """The weights step `step` samples with: those after step max(0, step - 1 - k)."""
    return max(0, step - 1 - max_staleness)


@dataclass
class SampledStep:
    """One step's complete sampling stage, as the sampler hands it to the learner."""

    step: int
    version: int  # sampled with the weights after this step
    collected: Collected
    rollout_s: float  # seconds the stage took
    stream: dict  # the data stream's metrics once it was drawn (bad rows, epoch, position)
    sampler_idle_s: float = 0.0  # seconds the sampler waited for its weights before it
    learner_idle_s: float = 0.0  # seconds the learner waited for it

    @property
    def tokens_per_s(self) -> float:
        return self.collected.tokens_sampled / self.rollout_s if self.rollout_s > 0 else 0.0


def sample_step(run, step: int, policy, engine, counters: dict, version: int) -> SampledStep:
    """Step `step`'s sampling stage with `policy` and `engine` (weights `version`): attempts of B prompts, scored,
    with advantages and valid groups, resampled until enough groups carry signal (sample.py); `counters` are the
    run's sampled completions and tokens before this step (budgets and trainer.max_completions)."""
    trainer, task = run.trainer, run.data.task
    started = time.perf_counter()
    if getattr(task, "judge", None) is not None:
        task.judge.new_step()  # a verdict that failed in the last step is asked again
    budget = RewardBudget(trainer.reward_budget_s)  # reward time of this step, over all its attempts
    stream = run.data.stream
    if isinstance(task, Mixture):  # task=mix: each task's prompts with its own engine and rollout settings
        def attempt():
            return sample_mixed_attempt(policy, task, stream, engines=run.data.engines, rollouts=run.data.rollouts,
                                        trainer=trainer, warn=run.warn, reward_budget=budget)
    else:
        def attempt():
            return sample_attempt(policy, task, stream, engine=engine, trainer=trainer, rollout=run.settings.rollout,
                                  warn=run.warn, reward_budget=budget)
    collected = collect_valid_groups(
        attempt, lambda attempt: global_counts(attempt, run.accelerator),
        # a teacher gives every group signal (gpg_vl/train/teacher/signal.py): no resampling for differing rewards
        beta_th=0.0 if getattr(run.learner, "teacher", None) is not None else trainer.beta_th,
        batch_size=trainer.batch_size,
        max_attempts=attempts_allowed(trainer, counters["completions_sampled"]),
        tokens_left=tokens_left(trainer, counters["tokens_sampled"]))
    record_outcomes(stream, collected.attempts, run.accelerator.num_processes)  # data.sampler=difficulty
    return SampledStep(step, version, collected, time.perf_counter() - started, stream.metrics())


def record_outcomes(stream, attempts, processes: int) -> None:
    """Each group's pass rate, for a stream whose sampler keeps them (data.sampler=difficulty), gathered from every
    process (collective then, on the sampler's group) so that every process's stream stays the same; else nothing."""
    if not stream.records:
        return
    local = [(attempt.task, index, rate) for attempt in attempts if attempt.rollout is not None
             for index, rate in zip(attempt.indices, group_pass_rates(attempt.components.get("accuracy"),
                                                                       attempt.rewards), strict=True)]
    if processes > 1:
        gathered = [None] * processes
        torch.distributed.all_gather_object(gathered, local, group=collective_group())
        local = [outcome for part in gathered for outcome in part]
    stream.record(local)


def count_sampled(counters: dict, sampled: SampledStep, group_size: int) -> None:
    """Add a step's sampled completions (resampling included) and generated tokens to `counters`."""
    counters["completions_sampled"] += sampled.collected.groups_sampled * group_size
    counters["tokens_sampled"] += sampled.collected.tokens_sampled


class SyncPipeline:
    """trainer.max_staleness = 0: each step is sampled in the learner's thread, with the learner's weights and
    engine, when the learner asks for it (the synchronous run, bit for bit).

    What the learner asks a pipeline, so that it never tests the mode: `stale` (the rollouts may be older than the
    learner's weights), `mismatch_warning` (the engine's log-probs off the learner's), `lost` (what a checkpoint holds
    when the engine is lost mid-step), `state_dict` (the steps in flight a checkpoint regenerates)."""

    k = 0  # the most steps a rollout is behind the learner
    stale = False  # the rollouts are the learner's own weights' (its correction resolves as on-policy)

    def __init__(self, run) -> None:
        self.run = run
        self.begun: dict | None = None  # the data position and random state the current step began with

    def take(self, step: int) -> SampledStep | None:
        run = self.run
        self.begun = {"stream": run.data.stream.state_dict(), "rng": rng_state()}  # a step the engine fails in
        return sample_step(run, step, run.learner.policy, run.engine, run.state.counters, step - 1)

    def mismatch_warning(self, result: dict) -> str | None:
        """The engine's sentence when its own log-probs are far off the learner's (an engine with its own weights,
        vLLM: off-policy where it should not be)."""
        return self.run.engine.mismatch_warning(result)

    def lost(self, error: BaseException) -> dict | None:
        """The engine was lost mid-step (`error`), the run stopping after the step before (`run.state.step`): when
        the step's update had not run, its prompts and random state go back to where the step began, so a resumed
        run draws and samples it again as the uninterrupted run does. No steps are in flight (None)."""
        del error
        if not self.run.state.updated and self.begun is not None:
            self.run.data.stream.load_state_dict(self.begun["stream"])
            set_rng_state(self.begun["rng"])
        return None

    def learned(self, step: int) -> None:
        """The learner finished step `step`'s update: an engine with its own weights takes them, as version `step`
        (also when the step changed no weight: the number stays the step's)."""
        if _has_own_weights(self.run.engine):
            self.run.engine.sync(self.run.learner.model, step)

    def released(self, step: int) -> None:
        """Step `step` is logged and saved: its weights may be sampled with."""

    def state_dict(self, lost: bool = False) -> dict | None:
        return None

    def close(self) -> None:
        pass


@dataclass
class _Shared:
    """What the two threads share, under `lock`."""

    lock: threading.Condition = field(default_factory=threading.Condition)
    versions: dict = field(default_factory=dict)  # step -> the trainable weights after it (released)
    pending: dict = field(default_factory=dict)  # step -> weights snapshotted, not yet released
    ready: dict = field(default_factory=dict)  # step -> SampledStep (None: the run's budget is spent)
    starts: dict = field(default_factory=dict)  # step -> the sampler's state as it began sampling that step
    next_step: int = 1  # the step the sampler samples next
    error: BaseException | None = None
    stop: bool = False


class AsyncPipeline:
    """trainer.max_staleness = k >= 1: a sampler thread on its own copy of the weights (see the module doc); it
    answers the learner as SyncPipeline does."""

    stale = True  # the rollouts are up to k steps behind (the correction's pi_prox is the learner's before the update)

    def __init__(self, run, *, resumed: dict | None = None) -> None:
        self.run, self.k = run, run.trainer.max_staleness
        policy = run.learner.policy
        family = copy.deepcopy(policy.family)  # its own tokenizer and processor: not shared across threads
        whole = run.learner.whole_copy  # FSDP2: taken before sharding
        model = whole if whole is not None else copy.deepcopy(policy.model)
        model.requires_grad_(False)
        self.policy = replace(policy, model=model, processor=family.processor, family=family)
        # An engine with its own weights (vLLM) stays the run's, synced from the sampler's copy; the HF engine
        # samples with the sampler's copy itself.
        self.own_weights = _has_own_weights(run.engine)
        self.engine = run.engine if self.own_weights else build_engine(
            run.settings.rollout, self.policy, accelerator=run.accelerator, tools=run.data.task.tools)
        start = run.state.start_step
        self.shared = _Shared(next_step=start + 1)
        self.shared.versions[start] = self._snapshot()
        self.loaded = start  # the weights in the sampler's copy: those after this step
        self.floor = start  # no version before it is known (a resume without the sampler's state)
        self.counters = {key: run.state.counters[key] for key in ("completions_sampled", "tokens_sampled")}
        self.generator = torch.Generator().manual_seed(run.settings.seed + run.accelerator.process_index
                                                       + SAMPLER_SEED_OFFSET)
        if resumed is not None:
            self.shared.versions.update(resumed["weights"])
            self.counters = dict(resumed["counters"])
            self.generator.set_state(process_generator(resumed["generator"], run.accelerator.process_index))
            self.floor = 0
        # the sampler's collectives, on a group of their own (collective: every process makes it here)
        self.group = torch.distributed.new_group(backend="gloo") if run.accelerator.num_processes > 1 else None
        threads = torch.get_num_threads()
        self.threads, self.restore_threads = max(1, threads // 2), threads
        torch.set_num_threads(self.threads)  # the learner's half (this thread); the sampler sets its own
        self.thread = threading.Thread(target=self._sample_steps, name="gpg-vl-sampler", daemon=True)
        self.thread.start()

    def version(self, step: int) -> int:
        return max(sampling_version(step, self.k), self.floor)

    # ---- the learner's side ----------------------------------------------------------------
    def take(self, step: int) -> SampledStep | None:
        """Step `step`'s sampled batch (waiting for it: learner_idle_s); None when the run's budget is spent."""
        shared, waited = self.shared, time.perf_counter()
        with shared.lock:
            shared.lock.wait_for(lambda: step in shared.ready or shared.error is not None)
            if shared.error is not None and step not in shared.ready:
                raise shared.error
            sampled = shared.ready.pop(step)
            for done in [s for s in shared.starts if s <= step]:
                del shared.starts[done]
        if sampled is not None:
            sampled.learner_idle_s = time.perf_counter() - waited
        return sampled

    def _snapshot(self) -> dict:
        """The learner's trainable weights, whole (under FSDP2 gathered from the shards: collective)."""
        return {name: whole_tensor(p.detach()).clone() for name, p in self.run.learner.policy.model.named_parameters()
                if p.requires_grad}

    def learned(self, step: int) -> None:
        """Snapshot the trainable weights after step `step` (released to the sampler by `released`)."""
        snapshot = self._snapshot()
        with self.shared.lock:
            self.shared.pending[step] = snapshot

    def released(self, step: int) -> None:
        """The weights after `step` may be sampled with; versions no later step samples with are dropped."""
        with self.shared.lock:
            if step in self.shared.pending:
                self.shared.versions[step] = self.shared.pending.pop(step)
            oldest = self.version(step + 1)
            for old in [v for v in self.shared.versions if v < oldest]:
                del self.shared.versions[old]
            self.shared.lock.notify_all()

    def state_dict(self, lost: bool = False) -> dict | None:
        """What regenerates the steps in flight after the learner's current step s (see the module doc): the
        sampler's state as it began step s + 1 (the data stream's position, its generator, its counters) and the
        weights steps s + 1 .. s + k sample with (those after steps s - k .. s - 1; the checkpoint's own are s's).
        `lost`: the sampler failed (its engine is gone): that state if it began step s + 1 before failing, else
        None."""
        shared, step = self.shared, self.run.state.step
        with shared.lock:
            shared.lock.wait_for(lambda: step + 1 in shared.starts or shared.error is not None)
            if lost and step + 1 not in shared.starts:
                return None
            if shared.error is not None and not lost:
                raise shared.error
            began = shared.starts[step + 1]
            weights = {v: w for v, w in shared.versions.items() if v < step}
        generators = [began["generator"]]  # every process's, in rank order (collective on the learner's group)
        if self.run.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            generators = gather_object(generators)
        return {**began, "generator": generators, "next_step": step + 1, "max_staleness": self.k,
                "weights": weights}

    def mismatch_warning(self, result: dict) -> str | None:
        """None: the sampler's log-probs are an older version's by design (the correction weighs them)."""
        del result
        return None

    def lost(self, error: BaseException) -> dict | None:
        """The engine was lost (`error`), the run stopping after the learner's current step s (`run.state.step`):
        the sampler's state as it began step s + 1, for the checkpoint after s; when the sampler never began it, the
        run stops in one sentence naming the last checkpoint to continue from."""
        in_flight = self.state_dict(lost=True)
        if in_flight is None:
            run = self.run
            last = latest_checkpoint(run.output_dir) if run.main else None
            run.stop(f"{str(error).rstrip('.')}; the run stopped at step {run.state.step + 1}: continue from its last "
                     f"checkpoint ({last.name if last else 'none was written'}) with resume=auto once that "
                     "server is back.")
        return in_flight

    def close(self) -> None:
        with self.shared.lock:
            self.shared.stop = True
            self.shared.lock.notify_all()
        self.thread.join()
        torch.set_num_threads(self.restore_threads)
        if self.own_weights and self.shared.error is None:  # evaluation after training samples with the learner's
            # weights (not when the sampler lost the engine: its error is the run's, and stays the one said)
            self.engine.sync(self.run.learner.model, self.run.state.step)

    # ---- the sampler's side ----------------------------------------------------------------
    def _sample_steps(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's intra-op threads (OpenMP's setting is per thread)
        with collectives_on(self.group):
            self._sample_until_stopped()

    def _sample_until_stopped(self) -> None:
        shared, last = self.shared, self.run.trainer.max_steps
        try:
            while True:
                with shared.lock:
                    step = shared.next_step
                    version = self.version(step)
                    shared.starts[step] = {"stream": copy.deepcopy(self.run.data.stream.state_dict()),
                                           "generator": self.generator.get_state(), "counters": dict(self.counters)}
                    shared.lock.notify_all()
                    waited = time.perf_counter()
                    shared.lock.wait_for(lambda s=step, v=version: shared.stop or s > last or v in shared.versions)
                    if shared.stop or step > last:
                        return
                    weights = shared.versions[version]
                idle = time.perf_counter() - waited
                if version != self.loaded:
                    self._load(weights, version)
                sampled = None
                if not budget_spent(self.run.trainer, self.counters):
                    with thread_generator(self.generator):
                        sampled = sample_step(self.run, step, self.policy, self.engine, self.counters, version)
                    sampled.sampler_idle_s = idle
                    count_sampled(self.counters, sampled, self.run.trainer.group_size)
                with shared.lock:
                    shared.ready[step] = sampled
                    shared.next_step = step + 1 if sampled is not None else last + 1
                    shared.lock.notify_all()
        except BaseException as error:  # handed to the learner, which raises it
            with shared.lock:
                shared.error = error
                shared.lock.notify_all()

    def _load(self, weights: dict, version: int) -> None:
        """Put the weights after step `version` into the sampler's copy (and an engine with its own weights)."""
        parameters = dict(self.policy.model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                parameters[name].copy_(value)
        if self.own_weights:
            self.engine.sync(self.policy.model, version)
        self.loaded = version


def whole_copy(model: torch.nn.Module, trainer, accelerator) -> torch.nn.Module | None:
    """Under FSDP2 with trainer.max_staleness >= 1, a copy of `model` taken before accelerate shards it: the
    sampler's (its weights then follow the learner's snapshots, gathered from the shards); else None."""
    from accelerate.utils import DistributedType

    if trainer.max_staleness and accelerator.distributed_type == DistributedType.FSDP:
        return copy.deepcopy(model)
    return None


def process_generator(saved, process_index: int) -> torch.Tensor:
    """This process's sampler generator state from a checkpoint's list of them (rank order); a checkpoint
    saved by fewer processes gives the others the first one's, as the RNG states are restored."""
    if isinstance(saved, torch.Tensor):  # saved by one process before the list
        return saved
    return saved[process_index] if process_index < len(saved) else saved[0]


def _has_own_weights(engine) -> bool:
    """Whether an engine samples with weights of its own (vLLM), which `sync` pushes in."""
    return bool(getattr(engine, "own_weights", False))


def start_pipeline(run):
    """The run's pipeline: synchronous at trainer.max_staleness = 0, else the sampler thread (with the steps in
    flight a resumed checkpoint holds). A resumed run's engine with its own weights (built with version 0) takes
    the resumed weights as the version of the step they are after."""
    if _has_own_weights(run.engine) and run.state.start_step:
        run.engine.sync(run.learner.model, run.state.start_step)
    if run.trainer.max_staleness == 0:
        return SyncPipeline(run)
    return AsyncPipeline(run, resumed=in_flight(run))


def in_flight(run) -> dict | None:
    """The steps a resumed checkpoint holds in flight (trainer.max_staleness >= 1), checked against this run's k."""
    if run.settings.resume_from is None or run.trainer.max_staleness == 0:
        return None
    state = load_in_flight(Path(run.settings.resume_from))
    if state is None:
        run.warn(f"{run.settings.resume_from} holds no steps in flight (saved with trainer.max_staleness=0): the "
                 "steps up to the next k sample with its weights, so the run differs from an uninterrupted one.")
    elif state["max_staleness"] != run.trainer.max_staleness:
        raise UserError(f"{run.settings.resume_from} was saved with trainer.max_staleness={state['max_staleness']}, "
                        f"and this run has {run.trainer.max_staleness}; resume with the same value.")
    return state


def staleness_note(max_staleness: int, max_steps: int) -> str | None:
    """One line when k >= 1 reaches the run's length: every step then samples with the initial weights (step n
    samples with those after step n - 1 - k <= 0), so the sampler never updates (None otherwise, and for one step)."""
    if max_staleness == 0 or max_steps < 2 or sampling_version(max_steps, max_staleness) > 0:
        return None
    most = f"at most {max_steps - 2}" if max_steps > 2 else "0"
    return (f"note: trainer.max_staleness={max_staleness} reaches this {max_steps}-step run: every step samples with "
            f"the initial weights, so the sampler never updates (set trainer.max_staleness to {most} for it to).")


def require_pipeline(trainer, rollout, accelerator) -> None:
    """Refuse, in one sentence and before any model loads, what trainer.max_staleness >= 1 cannot run with."""
    from accelerate.utils import DistributedType

    k = trainer.max_staleness
    if k == 0:
        return
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage >= 3:
        raise UserError(f"trainer.max_staleness={k} samples on a whole copy of the weights beside the learner, and "
                        "this launch runs DeepSpeed ZeRO-3, which loads the weights already partitioned; launch "
                        "with configs/accelerate/fsdp.yaml (FSDP2) or zero2.yaml, or set trainer.max_staleness=0.")
    problem = ENGINES.get(rollout.engine).asynchronous_problem(rollout, k)  # the engine's own settings
    if problem:
        raise UserError(problem)
    if trainer.eval_every and ENGINES.get(rollout.engine).own_weights:
        raise UserError(f"trainer.eval_every={trainer.eval_every} with trainer.max_staleness={k} would evaluate "
                        f"through rollout.engine={rollout.engine}, which holds the sampler's older weights while the "
                        "learner trains; set trainer.eval_every=0 (evaluation before and after training still runs, "
                        "after training with the learner's weights) or trainer.max_staleness=0.")
