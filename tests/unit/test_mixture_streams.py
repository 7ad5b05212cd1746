"""task=mix (gpg_vl/data/mixture.py) and data.sampler (gpg_vl/data/samplers.py): weights, per-task settings, the
mixed stream's draws and state, the difficulty sampler's rule and state, and the one-sentence refusals."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from gpg_vl.config.compose import load_config
from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.data.mixture import MixtureStream, build_mixture, mixture_weights, require_shared_run
from gpg_vl.data.samplers import DifficultySampler, UniformSampler, build_sampler, group_pass_rates
from gpg_vl.data.stream import PromptStream
from gpg_vl.errors import UserError
from gpg_vl.train.build import require_inputs


def one_sentence(error) -> str:
    message = str(error.value)
    assert message.count(". ") == 0 and message.endswith("."), message
    return message


@pytest.mark.parametrize("mixture, said", [
    ({}, "needs task.mixture"), (None, "needs task.mixture"), ({"shapes": 0}, "zero"),
    ({"shapes": 1, "motion": 0}, "task.mixture.motion=0"), ({"shapes": -1}, "task.mixture.shapes=-1"),
    ({"shapes": "a"}, "not a positive weight"), ({"shapes": True}, "not a positive weight"),
    ({"shapes": float("nan")}, "not a positive weight")])
def test_bad_weights_fail_in_one_sentence(mixture, said):
    with pytest.raises(UserError) as error:
        mixture_weights(mixture)
    assert said in one_sentence(error)


def test_an_unknown_task_in_the_mixture_is_named_with_the_known_ones():
    with pytest.raises(UserError) as error:
        build_mixture({"shapes": 1, "shpaes": 1}, {}, {})
    message = one_sentence(error)
    assert "unknown task 'shpaes' in task.mixture" in message and "motion" in message


def test_each_task_takes_its_configs_options_and_rollout_settings_then_its_own_overrides():
    mixture = build_mixture({"shapes": 1, "zoom": 3}, {"zoom": {"grid": 2}, "shapes": {"train_size": 40}},
                            {"zoom": {"max_new_tokens": 90}})
    assert list(mixture.tasks) == ["shapes", "zoom"] and mixture.weights == {"shapes": 1.0, "zoom": 3.0}
    assert mixture.tasks["zoom"].grid == 2 and len(mixture.tasks["shapes"].load("train")) == 40
    # configs/task/zoom.yaml owns max_turns=2 and max_total_tokens=400; the override wins for max_new_tokens
    assert mixture.rollouts["zoom"] == {"max_turns": 2, "max_new_tokens": 90, "max_total_tokens": 400}
    assert mixture.rollouts["shapes"] == {"max_new_tokens": 24}
    assert mixture.tools == ("zoom_in",)


@pytest.mark.parametrize("options, rollouts, data, said", [
    ({"motion": {"frames": 4}}, {}, {}, "task.options.motion names no task"),
    ({}, {"shapes": {"temperature": 0.5}}, {}, "task.rollout.shapes.temperature is not a rollout setting"),
    ({"shapes": {"nope": 1}}, {}, {}, "task.mixture.shapes: task 'shapes' has no option nope"),
    ({}, {}, {"path": "/data"}, "data.path points one task"),
])
def test_settings_no_task_of_the_mixture_can_take_fail_in_one_sentence(options, rollouts, data, said):
    with pytest.raises(UserError) as error:
        build_mixture({"shapes": 1}, options, rollouts, data=data)
    assert said in one_sentence(error)


def test_settings_two_tasks_cannot_share_fail_before_the_model_loads():
    mixture = build_mixture({"shapes": 1, "zoom": 1}, {}, {})
    with pytest.raises(UserError) as error:
        require_shared_run(mixture, RolloutSettings(engine="vllm", max_new_tokens=24), TrainerSettings())
    assert "task 'zoom' sets its own rollout settings" in one_sentence(error)
    with pytest.raises(UserError) as error:
        require_shared_run(mixture, RolloutSettings(), TrainerSettings(max_staleness=1))
    assert "trainer.max_staleness=0" in one_sentence(error)
    require_shared_run(mixture, RolloutSettings(), TrainerSettings())  # the HF engine: each task its own engine


def test_video_on_a_model_without_video_fails_before_it_loads():
    mixture = build_mixture({"shapes": 1, "motion": 1}, {}, {})
    with pytest.raises(UserError) as error:
        require_inputs(mixture, OmegaConf.create({"name_or_path": "tiny:gemma3", "family": "generic"}))
    assert "task 'motion' prompts with video, and the gemma3 model" in one_sentence(error)
    require_inputs(mixture, OmegaConf.create({"name_or_path": "embedded:tiny-qwen2.5-vl", "family": "qwen2_5_vl"}))
    require_inputs(build_mixture({"shapes": 1}, {}, {}),
                   OmegaConf.create({"name_or_path": "tiny:gemma3", "family": "generic"}))  # images only: fine


def test_unknown_sampler_fails_when_the_config_loads():
    with pytest.raises(UserError) as error:
        load_config("train", ["data.sampler=hardest"])
    assert "data.sampler='hardest', allowed: one of difficulty, uniform" in str(error.value)


def test_the_mix_config_composes_with_per_task_settings():
    cfg = load_config("train", ["task=mix", "task.mixture={shapes: 1, motion: 2}", "task.options.motion.frames=4",
                                "task.rollout.motion.max_new_tokens=16", "data.sampler=difficulty"])
    assert cfg.task.mixture == {"shapes": 1, "motion": 2} and cfg.task.options.motion.frames == 4
    assert cfg.task.rollout.motion.max_new_tokens == 16 and cfg.data.sampler == "difficulty"


class Rows(list):
    pass


class FakeTask:
    """A task whose rows are all good; `messages` holds no image."""

    def __init__(self, name):
        self.name = name

    def check_row(self, row):
        pass

    def messages(self, row):
        return [{"role": "user", "content": [{"type": "text", "text": str(row)}]}]


def fake_mixture(weights, sizes):
    tasks = {name: FakeTask(name) for name in weights}
    return SimpleNamespace(tasks=tasks, weights=weights), {n: [{"id": f"{n}{i}"} for i in range(sizes[n])]
                                                           for n in weights}


def mixed_stream(seed=0, weights=None, sizes=None, sampler=None):
    weights = weights or {"a": 1.0, "b": 3.0}
    mixture, rows = fake_mixture(weights, sizes or dict.fromkeys(weights, 50))
    return MixtureStream(mixture, rows, seed=seed, make_stream=lambda name, r: PromptStream(
        r, seed=seed, sampler=None if sampler is None else build_sampler(sampler, len(r), seed=seed)))


def test_prompts_are_drawn_by_weight_deterministically_per_seed_each_tagged_with_its_task():
    stream = mixed_stream()
    drawn = [stream.next_prompts(8) for _ in range(100)]
    assert all(p.row["id"].startswith(p.task) for step in drawn for p in step)
    assert all([p.task for p in step] == sorted(p.task for p in step) for step in drawn)  # grouped by task
    counts = Counter(p.task for step in drawn for p in step)
    assert 0.70 < counts["b"] / 800 < 0.80  # weight 3 of 4
    again = mixed_stream()
    assert [[(p.task, p.index) for p in s] for s in drawn] == \
        [[(p.task, p.index) for p in again.next_prompts(8)] for _ in range(100)]
    other = mixed_stream(seed=1)
    assert [[(p.task, p.index) for p in s] for s in drawn[:5]] != \
        [[(p.task, p.index) for p in other.next_prompts(8)] for _ in range(5)]


def test_weights_whose_sum_overflows_still_draw_every_task_by_its_share():
    """{a: 1e308, b: 1e308} summed to inf, and every prompt was b's (issue 59)."""
    assert mixture_weights({"shapes": 1e308, "motion": 1e308}) == {"shapes": 1e308, "motion": 1e308}
    for weights, share in (({"a": 1e308, "b": 1e308}, 0.5), ({"a": 1e308, "b": 1.5e308}, 0.6)):
        stream = mixed_stream(weights=weights)
        counts = Counter(p.task for _ in range(100) for p in stream.next_prompts(8))
        assert abs(counts["b"] / 800 - share) < 0.06, counts
    # ordinary weights draw exactly what they drew before (the scaling is for sums that overflow only)
    assert torch.equal(mixed_stream().weights, torch.tensor([1.0, 3.0], dtype=torch.float64))


def test_a_mixture_key_given_twice_on_the_command_line_is_refused():
    for typed, key in (("task.mixture={shapes: 1, shapes: 2}", "shapes"),
                       ("trainer.loss_options={max_tokens: 8, max_tokens: 16}", "max_tokens"),
                       ("task.options={motion: {frames: 4, frames: 8}}", "frames")):
        with pytest.raises(UserError) as error:
            load_config("train", ["task=mix", typed])
        assert one_sentence(error) == (f"{typed.split('=')[0]} names {key!r} twice ({typed.split('=', 1)[1]}); give "
                                       "each key once.")
    assert load_config("train", ["task=mix", "task.mixture={shapes: 1, motion: 2}"]).task.mixture == {
        "shapes": 1, "motion": 2}


def test_a_task_walks_its_split_as_it_would_alone():
    stream = mixed_stream(weights={"a": 1.0, "b": 1.0})
    alone = PromptStream([{"id": f"a{i}"} for i in range(50)], seed=0)
    taken = [p.index for _ in range(10) for p in stream.next_prompts(4) if p.task == "a"]
    assert taken == alone.next_indices(len(taken))


def test_the_mixed_stream_resumes_exactly_from_its_state():
    stream = mixed_stream(sampler="difficulty", sizes={"a": 5, "b": 7})
    for _ in range(3):
        for p in stream.next_prompts(4):
            stream.record([(p.task, p.index, 1.0)])  # all right: settled
    state = stream.state_dict()
    expected = [[(p.task, p.index) for p in stream.next_prompts(4)] for _ in range(20)]
    resumed = mixed_stream(sampler="difficulty", sizes={"a": 5, "b": 7})
    resumed.load_state_dict(state)
    assert [[(p.task, p.index) for p in resumed.next_prompts(4)] for _ in range(20)] == expected
    assert resumed.metrics()["a/sampler/settled"] > 0
    with pytest.raises(UserError, match="same task.mixture"):
        mixed_stream(weights={"a": 1.0, "c": 1.0}).load_state_dict(state)


def test_the_uniform_sampler_is_the_plain_walk():
    rows = list(range(30))
    plain, uniform = PromptStream(rows, seed=3), PromptStream(rows, seed=3, sampler=UniformSampler(30, seed=3))
    assert plain.next_indices(100) == uniform.next_indices(100)
    assert plain.state_dict() == uniform.state_dict()


def test_pass_rates_by_hand():
    accuracy = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert group_pass_rates(accuracy, torch.zeros(3, 4)) == [0.5, 1.0, 0.0]
    rewards = torch.tensor([[1.0, 1.0], [0.0, 2.0]])  # no accuracy reward: equal rewards read as settled
    assert group_pass_rates(None, rewards) == [0.0, 0.5]


def test_settled_prompts_come_back_less_often_and_never_vanish():
    size, epochs = 20, 40
    sampler = DifficultySampler(size, seed=0, keep=0.25, window=2)
    stream = PromptStream(list(range(size)), seed=0, sampler=sampler)
    settled = set(range(10))  # rows 0-9 are always all-right, 10-19 always informative
    draws = Counter()
    for _ in range(epochs * size // 4):
        for index in stream.next_indices(4):
            draws[index] += 1
            stream.record([(None, index, 1.0 if index in settled else 0.5)])
    easy = [draws[i] for i in settled]
    hard = [draws[i] for i in range(10, 20)]
    assert min(easy) >= 1  # never vanish
    assert sum(easy) < 0.5 * sum(hard)  # come back less often (about keep = 1/4 as often once settled)
    assert sampler.metrics()["sampler/settled"] == 10 and sampler.deferred > 0


def test_an_informative_group_unsettles_a_prompt_and_the_window_holds_its_last_groups():
    sampler = DifficultySampler(4, seed=0, keep=0.25, window=2)
    assert not sampler.settled(0)  # never drawn: always taken
    sampler.record(0, 0.0)
    assert sampler.settled(0)
    sampler.record(0, 0.5)
    assert not sampler.settled(0)
    sampler.record(0, 1.0)
    assert not sampler.settled(0)  # [0.5, 1.0]: the last two
    sampler.record(0, 0.0)
    assert sampler.settled(0) and sampler.rates[0] == [1.0, 0.0]


class CountedSampler(DifficultySampler):
    """The difficulty sampler, failing once asked more than `most` times (a walk that would spin fails here)."""

    most = 10_000

    def take(self, index):
        self.asked = getattr(self, "asked", 0) + 1
        if self.asked > self.most:
            raise AssertionError(f"the walk asked the sampler {self.asked} times")
        return super().take(index)


@pytest.mark.parametrize("size", [1, 7])
def test_a_walk_of_settled_rows_with_a_tiny_keep_still_moves_by_at_most_a_pass_per_prompt(size):
    """keep=1e-9 with every row settled spun for ever after step 1 (issue 59): a pass over the split in which every
    row is deferred ends with the next row taken anyway, said once."""
    warnings = []
    sampler = CountedSampler(size, seed=0, keep=1e-9, window=1)
    stream = PromptStream(list(range(size)), seed=0, sampler=sampler, warn=warnings.append)
    first = stream.next_indices(size)  # nothing recorded yet: every row taken at its turn
    assert sorted(first) == list(range(size)) and sampler.asked == size
    stream.record([(None, index, 1.0) for index in range(size)])  # every row settled
    for _ in range(3):
        asked = sampler.asked
        assert len(stream.next_indices(2)) == 2
        assert sampler.asked - asked <= 2 * size
    assert len(warnings) == 1 and warnings[0].startswith("data.sampler=difficulty deferred every row of a whole pass")
    resumed = PromptStream(list(range(size)), seed=0, sampler=CountedSampler(size, seed=0, keep=1e-9, window=1))
    again = PromptStream(list(range(size)), seed=0, sampler=CountedSampler(size, seed=0, keep=1e-9, window=1))
    again.next_indices(size), again.record([(None, index, 1.0) for index in range(size)])
    resumed.load_state_dict(again.state_dict())
    assert [resumed.next_indices(2) for _ in range(3)] == [again.next_indices(2) for _ in range(3)]


def test_a_plugin_entry_is_typed_with_an_escaped_colon_and_its_settings_under_its_name(tmp_path):
    """A `file.py:Class` entry needs Hydra's `\\:` in the map; its settings, which a key path cannot spell (dots and
    a colon), are written under the task's `name` (issue 59)."""
    from gpg_vl.train.build import build_task

    plugin = tmp_path / "mine.py"
    plugin.write_text("from gpg_vl_tasks.shapes import Shapes\nclass Mine(Shapes):\n    name = 'mine'\n")
    entry = f"{plugin}:Mine"
    cfg = load_config("train", ["task=mix", f"task.mixture={{{entry.replace(':', chr(92) + ':')}: 1, motion: 1}}",
                                "task.options.mine.train_size=40", "task.rollout.mine.max_new_tokens=12"])
    assert dict(cfg.task.mixture) == {entry: 1, "motion": 1}
    mixture = build_task(cfg.task, cfg.data)
    assert list(mixture.tasks) == ["mine", "motion"] and len(mixture.tasks["mine"].load("train")) == 40
    assert mixture.rollouts["mine"] == {"max_new_tokens": 12}
    # the entry itself still works as the key (in a map typed with `\\:`), and a name of no entry is refused
    same = build_mixture({entry: 1}, {entry: {"train_size": 30}}, {})
    assert len(same.tasks["mine"].load("train")) == 30
    with pytest.raises(UserError) as error:
        build_mixture({entry: 1}, {"yours": {"train_size": 30}}, {})
    assert "task.options.yours names no task of task.mixture" in one_sentence(error)


def test_a_mixture_inside_a_mixture_is_refused_as_such():
    with pytest.raises(UserError) as error:
        build_mixture({"mix": 1, "shapes": 1}, {}, {})
    assert one_sentence(error) == "task.mixture cannot hold a mixture (mix); list its tasks directly."
