"""The vstar, hrbench and deepeyes tasks on fixtures in the published layouts (tests/helpers/thinking_fixtures.py): they
load, prompt (messages and tools rendered by the tiny model's chat template), score by hand-worked rewards,
report per-category metrics, and V* and HR-Bench evaluate through the CLI with multi-turn decoding."""

import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import datasets
import gpg_vl_tasks.deepeyes
import gpg_vl_tasks.vstar
import pytest
from helpers.runs import tiny_family_policy
from helpers.thinking_fixtures import (  # tests/helpers/thinking_fixtures.py: the published layouts, built on the fly
    DEEPEYES_SYSTEM,
    SIZE,
    V_STAR_LINE,
    VSTAR_ROWS,
    deepeyes_parquet,
    hrbench_parquet,
    hrbench_tsv,
    vstar_folder,
    vstar_parquet,
)
from omegaconf import OmegaConf

from gpg_vl import get_task
from gpg_vl.cli import eval_main, train_main
from gpg_vl.config.compose import load_config
from gpg_vl.errors import BadRow, SkippedRow, UserError
from gpg_vl.reward.judge import EndpointJudge
from gpg_vl.rollout.engine import build_engine, encode_prompts
from gpg_vl.rollout.multiturn.tools import TOOLS
from gpg_vl.train.build import build_judge

OK_CROP = '</tool_call>\nuser\n<tool_response>\n\n</tool_response>\nassistant\n'  # a crop, decoded: no text
REFUSED = '</tool_call>\nuser\n<tool_response>\nError: the box is 3 x 3 pixels.\n</tool_response>\nassistant\n'
CALL = '<think>too small</think><tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": [390, 290, 420, 320]}}'


def answered(answer, crop=OK_CROP):
    """A decoded two-turn trajectory: a call, the observation `crop`, then the answer."""
    return f"{CALL}{crop}<think>it is clear now</think><answer>{answer}</answer>"


def single(answer):
    return f"<think>looking</think><answer>{answer}</answer>"


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    vstar_folder(root / "vstar")
    vstar_parquet(root / "vstar.parquet")
    (root / "hr").mkdir()
    hrbench_tsv(root / "hr" / "hr_bench_4k.tsv")
    hrbench_parquet(root / "hr_bench_8k.parquet")
    deepeyes_parquet(root / "train.parquet")
    return root


# ---------------------------------------------------------------- V*

def test_vstar_loads_both_published_layouts_alike_and_shuffles_the_options_by_seed(data):
    jsonl, folder = get_task("vstar", data_path=data / "vstar" / "test_questions.jsonl"), get_task(
        "vstar", data_path=data / "vstar")
    parquet = get_task("vstar", data_path=data / "vstar.parquet")
    rows = [list(task.load("test")) for task in (jsonl, folder, parquet)]
    assert [len(r) for r in rows] == [5, 5, 5]
    for a, b in zip(rows[0], rows[2], strict=True):
        assert (a["choices"], a["answer"], a["category"]) == (b["choices"], b["answer"], b["category"])
        assert a["image"].size == b["image"].size == SIZE
    for row, (_, _, options, _) in zip(rows[0], VSTAR_ROWS, strict=True):
        assert sorted(row["choices"]) == sorted(options)
        assert row["choices"]["ABCD".index(row["answer"])] == options[0]  # the label follows its option
    assert {row["answer"] for row in rows[0]} != {"A"}  # the seeded order moved some right options off A
    unshuffled = list(get_task("vstar", data_path=data / "vstar", shuffle_options=False).load("test"))
    assert [row["answer"] for row in unshuffled] == ["A"] * 5
    assert [row["choices"][0] for row in unshuffled] == [options[0] for _, _, options, _ in VSTAR_ROWS]
    reseeded = [list(get_task("vstar", data_path=data / "vstar", seed=s).load("test")) for s in (0, 1)]
    assert [r["choices"] for r in reseeded[0]] == [r["choices"] for r in rows[0]]  # the same seed: the same order
    assert [r["choices"] for r in reseeded[1]] != [r["choices"] for r in rows[0]]


def test_vstar_prompt_lists_the_zoom_tool_through_the_chat_template(data):
    task = get_task("vstar", data_path=data / "vstar")
    row = task.load("test")[0]
    (message,) = task.messages(row)
    text = message["content"][1]["text"]
    assert message["content"][0]["image"].size == SIZE
    assert text.startswith("What is the color of the square?\n(A) green\n(B) yellow\n(C) blue\n(D) red\n")
    assert text.endswith(gpg_vl_tasks.vstar.INSTRUCTION) and V_STAR_LINE not in text
    policy = tiny_family_policy("qwen2_5_vl", None)
    rollout = OmegaConf.to_object(load_config("eval", ["task=vstar", "rollout.max_turns=3"]).rollout)
    engine = build_engine(rollout, policy, tools=task.tools)
    tools = engine.prompt_tools(task)
    assert [tool["function"]["name"] for tool in tools] == ["zoom_in"]
    rendered = policy.family.render(task.messages(row), tools=tools)
    assert '"name": "zoom_in"' in rendered and "<tool_call>" in rendered and "(D) red" in rendered
    batch = encode_prompts(policy, [task.messages(row)], tools=tools).batch
    assert len(batch) == 1 and '"name": "zoom_in"' in batch.texts[0]
    assert batch.image_sizes[0][0][:2] == SIZE  # the original size; the model sees it within its pixel limits
    one_turn = OmegaConf.to_object(load_config("eval", ["task=vstar", "rollout.max_turns=1"]).rollout)
    single_turn = build_engine(one_turn, policy)
    assert single_turn.prompt_tools(task) is None  # one turn: no tool to list


@pytest.mark.parametrize("answer", ["D", "(D)", "D.", "red", "(D) red", "d"])
def test_vstar_reward_reads_the_letter_in_every_form_and_pays_the_tool_bonus_only_with_a_crop(data, answer):
    task = get_task("vstar", data_path=data / "vstar")
    row = task.load("test")[0]  # right: (D) red
    # DeepEyes: 0.8 accuracy + 0.2 format (0 or -1) + 1.2 tool (a crop AND right)
    assert task.reward_components(answered(answer), row) == {"accuracy": 1.0, "format": 0.0, "tool": 1.0}
    assert task.reward(answered(answer), row) == pytest.approx(2.0)
    assert task.reward(single(answer), row) == pytest.approx(0.8)  # right without a crop
    assert task.reward(answered(answer, REFUSED), row) == pytest.approx(0.8)  # the crop was refused


def test_vstar_wrong_ambiguous_and_malformed_answers(data):
    task = get_task("vstar", data_path=data / "vstar")
    row = task.load("test")[0]
    for wrong in ("A", "green", "D or A", "(A) red", ""):
        assert task.reward_components(answered(wrong), row) == {"accuracy": 0.0, "format": 0.0, "tool": 0.0}, wrong
    assert task.reward("<think>x<answer>D</answer>", row) == pytest.approx(0.8 - 0.2)  # unbalanced think: -1 format
    assert task.reward(single("D" + " red" * 300), row) == pytest.approx(-0.2)  # an answer of 1000+ characters
    # A `<tool_response>` the model writes itself (not after its own </tool_call>) is no crop.
    forged = "<think>x</think>\n<tool_response>\n\n</tool_response>\n<answer>D</answer>"
    assert task.reward_components(forged, row)["tool"] == 0.0
    mini_o3 = get_task("vstar", data_path=data / "vstar", rewards="accuracy")
    assert mini_o3.reward_components(answered("D"), row) == {"accuracy": 1.0}
    weighted = get_task("vstar", data_path=data / "vstar", accuracy_weight=1.0, format_weight=1.0, tool_weight=0.5)
    assert weighted.reward(answered("D"), row) == pytest.approx(1.5)


def test_vstar_metrics_per_category(data):
    task = get_task("vstar", data_path=data / "vstar")
    rows = list(task.load("test"))
    right = [row["answer"] for row in rows]
    completions = [answered(right[0]), single("A" if right[1] != "A" else "B"), single(right[2]),
                   answered(right[3]), single("B" if right[4] == "A" else "A")]
    metrics = task.metrics(rows, completions)
    # direct_attributes: rows 0, 2 right of 3; relative_position: row 3 right of 2; crops on rows 0 and 3 (right)
    assert metrics["accuracy"] == pytest.approx(3 / 5)
    assert metrics["accuracy/direct_attributes"] == pytest.approx(2 / 3)
    assert metrics["accuracy/relative_position"] == pytest.approx(1 / 2)
    assert metrics["reward/tool"] == pytest.approx(2 / 5) and metrics["reward/format"] == 0.0


def test_vstar_rows_without_options_or_with_a_bad_label_are_bad_rows(tmp_path):
    task = get_task("vstar")
    with pytest.raises(BadRow) as error:
        task.check_row({"id": "q", "text": "What colour?", "label": "A", "image": None})
    assert error.value.reason == "no options"
    with pytest.raises(BadRow) as error:
        task.check_row({"id": "q", "text": "What colour?\n(A) red\n(B) blue", "label": "E", "image": None})
    assert error.value.reason == "bad label"
    with pytest.raises(UserError, match="has no option colour; its options are: shuffle_options, seed, rewards"):
        get_task("vstar", colour="red")
    with pytest.raises(UserError, match="no tool-use reward set 'deepeye'|deepeye"):
        get_task("vstar", rewards="deepeye")


# ---------------------------------------------------------------- HR-Bench

def test_hrbench_loads_tsv_with_shared_images_and_parquet_alike(data):
    tsv = list(get_task("hrbench", data_path=data / "hr").load("test"))
    parquet = list(get_task("hrbench", data_path=data / "hr_bench_8k.parquet", resolution="8k").load("test"))
    assert len(tsv) == len(parquet) == 8
    for a, b in zip(tsv, parquet, strict=True):
        assert (a["choices"], a["answer"], a["cycle_category"]) == (b["choices"], b["answer"], b["cycle_category"])
        assert a["image"].size == SIZE and a["image"].tobytes() == b["image"].tobytes()
    assert [row["answer"] for row in tsv] == ["A", "D", "C", "B"] * 2  # the right option rotates with the cycle
    assert tsv[1]["choices"] == ["blue", "green", "yellow", "red"]
    (message,) = get_task("hrbench", data_path=data / "hr").messages(tsv[1])
    assert [part["type"] for part in message["content"]] == ["image", "text"]
    assert message["content"][1]["text"] == ("What color is the small square?\n(A) blue\n(B) green\n(C) yellow\n"
                                             f"(D) red\n{gpg_vl_tasks.vstar.INSTRUCTION}")
    assert get_task("hrbench").target(tsv[1]) == "(D) red"
    with pytest.raises(UserError, match="resolution"):
        get_task("hrbench", resolution="2k")


def test_hrbench_metrics_average_each_category_over_the_cycles(data):
    task = get_task("hrbench", data_path=data / "hr")
    rows = list(task.load("test"))
    # single: right in cycles 1, 2, 3 (3/4); cross: right in cycle 1 only (1/4)
    right = [True, True, True, False, True, False, False, False]
    completions = [single(row["answer"] if ok else "A" if row["answer"] != "A" else "B")
                   for row, ok in zip(rows, right, strict=True)]
    metrics = task.metrics(rows, completions)
    assert metrics["single"] == pytest.approx(3 / 4) and metrics["cross"] == pytest.approx(1 / 4)
    assert metrics["average"] == pytest.approx(1 / 2) and metrics["accuracy"] == pytest.approx(4 / 8)
    # a cycle with fewer rows weighs as much as a full one: the mean of per-cycle accuracies. `average` is
    # HR-Bench's "Average / all": per cycle the accuracy over ALL its rows (1, 1/2, 1/2, 0 here: cycle 4 keeps its
    # wrong cross row only), averaged over the cycles = 1/2, not the mean of single (1) and cross (1/4) = 5/8
    metrics = task.metrics(rows[:3] + rows[4:], completions[:3] + completions[4:])
    assert metrics["single"] == pytest.approx(1.0) and metrics["cross"] == pytest.approx(1 / 4)
    assert metrics["average"] == pytest.approx(1 / 2) and metrics["accuracy"] == pytest.approx(4 / 7)


# ---------------------------------------------------------------- DeepEyes-47k

def test_deepeyes_rows_keep_their_prompt_and_the_tool_it_names(data):
    task = get_task("deepeyes", data_path=data / "train.parquet")
    rows = task.load("train")
    row = rows[0]
    system, user = task.messages(row)
    assert system == {"role": "system", "content": DEEPEYES_SYSTEM}
    assert [part["type"] for part in user["content"]] == ["image", "text"]
    assert user["content"][0]["image"].size == SIZE
    assert user["content"][1]["text"].startswith("\nWhat is the color of the square?\n(A) blue\n(B) red")
    assert task.tools == ("image_zoom_in_tool",) and not task.describe_tools and "image_zoom_in_tool" in TOOLS
    policy = tiny_family_policy("qwen2_5_vl", None)
    rollout = OmegaConf.to_object(load_config("train", ["task=deepeyes", "rollout.max_turns=3"]).rollout)
    engine = build_engine(rollout, policy, tools=task.tools)
    assert engine.prompt_tools(task) is None  # the data's system message lists the tool: never twice
    rendered = policy.family.render(task.messages(row), tools=engine.prompt_tools(task))
    assert rendered.count("# Tools") == 1 and rendered.count('"name":"image_zoom_in_tool"') == 1


def test_deepeyes_scores_letters_short_answers_and_numbers_by_rule(data):
    task = get_task("deepeyes", data_path=data / "train.parquet")
    rows = task.load("train")
    letter, short, number = rows[0], rows[1], rows[2]
    zoom = CALL.replace('"zoom_in"', '"image_zoom_in_tool"')
    crop = f"{zoom}{OK_CROP}<think>red</think><answer>B</answer>"
    assert task.reward_components(crop, letter) == {"accuracy": 1.0, "format": 0.0, "tool": 1.0}
    assert task.reward(crop, letter) == pytest.approx(2.0)
    for right, row in (("(B)", letter), ("red", letter), ("Green.", short), ("1.0", number), ("1", number)):
        assert task.reward(single(right), row) == pytest.approx(0.8), right
    for wrong, row in (("A", letter), ("blue", short), ("2", number), ("", short)):
        assert task.reward(single(wrong), row) == 0.0, wrong


def test_deepeyes_skips_sentence_answers_without_a_judge_with_a_counted_reason(data):
    task = get_task("deepeyes", data_path=data / "train.parquet")
    sentence = datasets.Dataset.from_parquet(str(data / "train.parquet"))[3]  # the published row
    with pytest.raises(BadRow) as error:
        task.check_row(sentence)
    assert error.value.reason == "sentence answer without a judge" and "reward.judge.kind=" in str(error.value)
    assert isinstance(error.value, SkippedRow)  # by design: outside data.max_bad_fraction
    assert gpg_vl_tasks.deepeyes.answer_kind("The square is blue.") == "sentence"
    assert gpg_vl_tasks.deepeyes.answer_kind("dark blue") == "short"
    assert gpg_vl_tasks.deepeyes.answer_kind("(C)") == "letter"


@pytest.fixture()
def judge_server():
    """A local stand-in for an OpenAI-compatible endpoint: POST /v1/chat/completions answers "Yes" when the
    model's answer in the prompt holds 'blue', else "No"; (its base URL, the request bodies it got)."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append(body)
            answer = body["messages"][0]["content"].split("Model's answer:")[1].split("\n")[0]
            reply = {"choices": [{"message": {"role": "assistant", "content": "Yes" if "blue" in answer else "No"}}]}
            data = json.dumps(reply).encode()
            status = 200 if self.path == "/v1/chat/completions" else 404
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", asked
    server.shutdown()
    server.server_close()


def judged(reward_cfg: dict, task):
    """`task` with the judge the `reward.*` section `reward_cfg` names, as the setup builds it."""
    build_judge(OmegaConf.create(reward_cfg), task, "cpu")
    return task


def test_deepeyes_judges_sentence_answers_through_an_openai_compatible_endpoint(data, judge_server):
    url, asked = judge_server
    task = judged({"judge": {"kind": "endpoint", "url": url, "model": "stub"}},
                  get_task("deepeyes", data_path=data / "train.parquet"))
    assert isinstance(task.judge, EndpointJudge)
    row = task.load("train")[3]  # "The square is blue."
    task.check_row(row)
    assert task.reward_components(single("It is blue"), row) == {"accuracy": 1.0, "format": 0.0, "tool": 0.0}
    assert task.reward(answered("blue"), row) == pytest.approx(2.0)  # judged right, with a crop
    assert task.reward(single("red"), row) == 0.0
    assert asked[0]["model"] == "stub" and ("Question: What is the color of the square?\nReference answer: The "
                                           "square is blue.") in asked[0]["messages"][0]["content"]
    before = task.judge.requests
    task.reward(single("It is blue"), row)  # asked before: the memo answers
    assert task.judge.requests == before


def test_an_unreachable_judge_is_one_sentence_at_the_start_and_a_missing_score_later_never_a_silent_zero(data):
    from helpers.judge_endpoint import ScriptedJudge

    from gpg_vl.rollout.engine import EngineUnreachable

    with pytest.raises(UserError, match=r"^the judge at reward.judge.url cannot be reached: .* within 2 s"):
        judged({"judge": {"kind": "endpoint", "url": "http://127.0.0.1:9", "timeout_s": 2}},
               get_task("deepeyes", data_path=data / "train.parquet"))
    with ScriptedJudge(lambda answer, body: "yes") as server:
        task = judged({"judge": {"kind": "endpoint", "url": server.url, "timeout_s": 2}},
                      get_task("deepeyes", data_path=data / "train.parquet"))
    row = task.load("train")[3]  # the server is gone now
    components = task.reward_components(single("blue"), row)
    assert math.isnan(components["accuracy"]) and components["tool"] == 0.0 and task.reward_errors == {}
    assert isinstance(task.judge.lost, EngineUnreachable)  # the scoring raises it: the run checkpoints and stops


def test_evaluation_through_the_cli_gives_deepeyes_the_runs_judge(data, judge_server, tmp_path):
    """scripts/eval.py re-scoring saved completions (no policy model): the sentence row is judged by the endpoint
    reward.judge.* names, as in training."""
    url, asked = judge_server
    predictions = tmp_path / "predictions.jsonl"
    answers = ["B", "green", "1", "It is blue"]  # each row's right answer; the last one only a judge can tell
    predictions.write_text("".join(json.dumps({"index": i, "id": f"deepeyes-train-{i}", "split": "train",
                                               "completion": single(a)}) + "\n" for i, a in enumerate(answers)))
    metrics = eval_main(load_config("eval", [
        "task=deepeyes", f"data.path={data / 'train.parquet'}", f"predictions={predictions}",
        "reward.judge.kind=endpoint", f"reward.judge.url={url}", f"output_dir={tmp_path / 'eval'}"]))
    assert metrics["accuracy"] == 1.0 and len(asked) == 1
    assert "Model's answer: It is blue" in asked[0]["messages"][0]["content"]


@pytest.mark.parametrize(("judge", "words"), [
    ({"kind": "endpoint"}, "needs reward.judge.url"),
    ({"kind": "endpoint", "url": "localhost:8000"}, "reward.judge.url='localhost:8000' is not an http"),
    ({"kind": "local"}, "needs reward.judge.model"),
    ({"kind": "local", "model": "/no/such/judge"}, "reward.judge.model='/no/such/judge' does not exist"),
    ({"kind": "local", "model": "no-org/no-judge"}, "without network access, download it elsewhere and pass "
                                                    "reward.judge.model="),
])
def test_a_judge_that_cannot_be_built_is_one_sentence(data, judge, words):
    with pytest.raises(UserError, match=re.escape(words)) as error:
        judged({"judge": judge}, get_task("deepeyes", data_path=data / "train.parquet"))
    assert "\n" not in str(error.value)


def test_the_old_task_option_names_the_new_key_and_a_task_without_sentences_gets_no_judge(data, judge_server,
                                                                                         tmp_path):
    for old in ("judge", "judge_model", "judge_timeout_s"):
        with pytest.raises(UserError, match=f"task.options.{old} is gone.*reward.judge.kind=endpoint"):
            get_task("deepeyes", **{old: "x"})
    with pytest.raises(UserError, match="task.options.judge is gone"):  # on the command line, before any model
        train_main(load_config("train", ["task=deepeyes", "model=tiny", f"task.options.judge={judge_server[0]}",
                                         f"output_dir={tmp_path}"]))
    with pytest.warns(UserWarning, match="task 'vstar' never asks a judge"):
        task = judged({"judge": {"kind": "endpoint", "url": judge_server[0]}},
                      get_task("vstar", data_path=data / "vstar"))
    assert task.judge is None
    assert judged({"judge": {"kind": "none"}}, get_task("deepeyes")).judge is None


# ---------------------------------------------------------------- evaluation through the CLI

def run_eval(tmp_path, *overrides):
    metrics = eval_main(load_config("eval", [*overrides, "model=tiny", "eval.batch_size=8", "eval.max_new_tokens=12",
                                             "rollout.max_turns=3", "rollout.max_total_tokens=256",
                                             f"output_dir={tmp_path}"]))
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    return metrics, records


def test_vstar_evaluates_through_the_cli_with_tools(data, tmp_path):
    metrics, records = run_eval(tmp_path, "task=vstar", f"data.path={data / 'vstar'}")
    assert len(records) == 5 and {"accuracy", "accuracy/direct_attributes", "accuracy/relative_position",
                                  "turns_mean", "tool_calls_mean", "reward/tool"} <= set(metrics)
    assert 1.0 <= metrics["turns_mean"] <= 3.0
    assert metrics["accuracy"] == pytest.approx(sum(r["rewards"]["accuracy"] for r in records) / 5)
    assert records[0]["target"] == "(D) red"


def test_hrbench_evaluates_through_the_cli_with_tools(data, tmp_path):
    metrics, records = run_eval(tmp_path, "task=hrbench", f"data.path={data / 'hr'}")
    assert len(records) == 8 and {"single", "cross", "average", "turns_mean"} <= set(metrics)
    assert metrics["average"] == pytest.approx((metrics["single"] + metrics["cross"]) / 2)


def test_always_answering_a_scores_full_marks_unshuffled_and_chance_shuffled(data, tmp_path):
    """Re-scoring (no model) predictions that always say A, through the CLI: the published order rewards the
    position bias; the seeded shuffle scores it as the fraction of questions whose right option stayed on A."""
    rows = list(get_task("vstar", data_path=data / "vstar").load("test"))
    predictions = tmp_path / "always_a.jsonl"
    predictions.write_text("".join(json.dumps({"index": i, "id": row["id"], "split": "test",
                                               "completion": single("A")}) + "\n" for i, row in enumerate(rows)))
    accuracy = {}
    for shuffle in ("false", "true"):
        accuracy[shuffle] = eval_main(load_config("eval", [
            "task=vstar", f"data.path={data / 'vstar'}", f"predictions={predictions}",
            f"task.options.shuffle_options={shuffle}", f"output_dir={tmp_path / shuffle}"]))["accuracy"]
    assert accuracy["false"] == 1.0
    stayed = sum(row["answer"] == "A" for row in rows) / len(rows)
    assert stayed < 1.0 and accuracy["true"] == pytest.approx(stayed)


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    """The docs' one-file tool task, written once (a second file would register the task name again)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "thinking-with-images.md").read_text()
    plugin = tmp_path_factory.mktemp("plugin") / "spot.py"
    plugin.write_text(re.search(r"```python\n# spot.py\n(.*?)```", page, re.DOTALL).group(1))
    return plugin


def test_the_docs_tool_task_in_one_file_evaluates_with_the_tool(spot, tmp_path):
    plugin = spot
    metrics = eval_main(load_config("eval", [
        f"task={plugin}:Spot", "model=tiny", "eval.limit=4", "eval.batch_size=4", "eval.max_new_tokens=12",
        "rollout.max_turns=2", "rollout.max_total_tokens=128", f"output_dir={tmp_path / 'eval'}"]))
    assert {"accuracy", "reward/tool", "reward/format", "turns_mean", "tool_calls_mean"} <= set(metrics)
    task = get_task(f"{plugin}:Spot")
    row = task.load("test")[0]
    crop = f"{CALL}{OK_CROP}<think>seen</think><answer>{row['answer']}</answer>"
    assert task.reward(crop, row) == pytest.approx(2.0)
    assert task.reward(single(row["answer"]), row) == pytest.approx(0.8)
    assert task.tools == ("zoom_in",)


DEEPEYES_RUN = ["task=deepeyes", "model=tiny", "trainer.max_steps=2", "trainer.epochs=null", "trainer.batch_size=2",
                "trainer.group_size=2", "rollout.max_new_tokens=8", "trainer.beta_th=0", "trainer.eval_before=false",
                "trainer.eval_after=false", "trainer.save_every=0", "data.max_bad_fraction=0.5"]


def deepeyes_training(data, out, *overrides):
    summary = train_main(load_config("train", [*DEEPEYES_RUN, f"data.path={data / 'train.parquet'}",
                                               f"output_dir={out}", *overrides]))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, lines


def test_deepeyes_trains_two_steps_through_the_cli_skipping_sentence_rows_by_reason(data, tmp_path, capsys):
    """Sentence rows without a judge are skipped by design, not bad: even data.max_bad_fraction=0 trains on."""
    summary, lines = deepeyes_training(data, tmp_path / "run", "rollout.max_turns=1", "data.max_bad_fraction=0")
    assert summary["task"] == "deepeyes" and summary["steps"] == 2 and [m["step"] for m in lines] == [1, 2]
    counted = json.loads((tmp_path / "run" / "summary.json").read_text())["data"]
    assert counted["by_reason"] == {} and counted["bad_rows"] == 0
    skipped = counted["skipped_rows"]["sentence answer without a judge"]  # the one sentence row, each time it is met
    assert skipped >= 1 and lines[-1]["skipped_rows/sentence answer without a judge"] == skipped
    note = ("1 of 4 training rows have a sentence ground truth, which only a judge can score: they are skipped (not "
            "counted as bad rows); set reward.judge.kind=")
    assert sum(line.startswith(note) for line in capsys.readouterr().out.splitlines()) == 1
    assert {"reward/accuracy", "reward/format", "reward/tool"} <= set(lines[0])


def test_deepeyes_trains_two_steps_through_the_cli_with_a_local_judge_scoring_sentence_rows(data, tmp_path,
                                                                                          monkeypatch):
    from gpg_vl.models.tiny import EMBEDDED_TINY
    from gpg_vl.train import build

    built = []
    monkeypatch.setattr(build, "build_judge", lambda *a, real=build.build_judge: built.append(real(*a)) or built[-1])
    # the tiny model writes no <answer> tag in 8 tokens: as in DeepEyes, a reply without one is its own answer
    # text, so every non-empty completion of the sentence row goes to the judge
    summary, lines = deepeyes_training(data, tmp_path / "run", "rollout.max_turns=1", "reward.judge.kind=local",
                                       f"reward.judge.model={EMBEDDED_TINY}", "reward.judge.batch_size=4")
    assert summary["steps"] == 2 and [m["step"] for m in lines] == [1, 2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["data"]["by_reason"] == {}
    judge = built[0]
    assert judge.judged > 0 and judge.forwards >= 1  # the sentence row's completions went to the judge
    assert all(asked == "What is the color of the square?" and reference == "The square is blue."
               for asked, reference, _ in judge._memo)  # extra_info.question, as DeepEyes' judge reads it


def test_a_deepeyes_trajectory_that_crops_with_its_tool_earns_the_bonus(data):
    """A real rollout on the tiny model, its two segments scripted: DeepEyes' `image_zoom_in_tool` on the square
    (absolute pixels of the original, converted by the family), then the right letter; the decoded trajectory
    scores 0.8 + 1.2, and the same answer without the call scores 0.8."""
    from gpg_vl.rollout.engine import Sampling
    from gpg_vl.rollout.multiturn.decoding import generate_trajectories
    from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings

    task = get_task("deepeyes", data_path=data / "train.parquet")
    row = task.load("train")[0]  # the red square at (400, 300), ground truth "B" (red)
    policy = tiny_family_policy("qwen2_5_vl", None)
    prompts = encode_prompts(policy, [task.messages(row)], tools=None)
    family, size = policy.family, prompts.batch.image_sizes[0][0]
    box = [round(v) for v in family.to_model_frame((370, 270, 440, 340), size)]
    call = f'<tool_call>\n{{"name": "image_zoom_in_tool", "arguments": {{"bbox_2d": {box}}}}}\n</tool_call>'
    answer = "<think>the square is red</think><answer>B</answer>"
    ids = family.tokenizer([call, answer], add_special_tokens=False)["input_ids"]
    segments = {0: ids[0], 1: ids[1] + [sorted(family.eos_ids)[0]]}  # the answer ends the turn
    rollout = generate_trajectories(
        policy, prompts, group_size=1, sampling=Sampling(max_new_tokens=120, greedy=True),
        settings=MultiTurnSettings(max_turns=3), tools=task.tools, scripted=lambda r, turn: segments[turn])
    (trajectory,), (text,) = rollout.trajectories, rollout.texts
    assert [(c.name, c.error, c.images) for c in trajectory.calls] == [("image_zoom_in_tool", False, 1)]
    assert trajectory.turns == 2 and text.endswith(answer)
    assert task.reward_components(text, row) == {"accuracy": 1.0, "format": 0.0, "tool": 1.0}
    assert task.reward(text, row) == pytest.approx(2.0)
    assert task.reward(answer, row) == pytest.approx(0.8)


def test_deepeyes_trains_two_multi_turn_steps_through_the_cli(data, tmp_path):
    summary, lines = deepeyes_training(data, tmp_path / "run", "rollout.max_turns=3", "rollout.max_total_tokens=64")
    assert summary["steps"] == 2 and [m["step"] for m in lines] == [1, 2]
    assert {"reward/tool", "turns_mean", "tool_calls_mean"} <= set(lines[0])


def test_the_docs_tool_task_in_one_file_trains_two_steps_with_the_tool(spot, tmp_path):
    plugin = spot
    out = tmp_path / "run"
    summary = train_main(load_config("train", [
        f"task={plugin}:Spot", "model=tiny", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.group_size=2",
        "rollout.max_new_tokens=8", "rollout.max_turns=2", "rollout.max_total_tokens=64", "trainer.beta_th=0",
        "trainer.eval_before=false", "eval.limit=2", f"output_dir={out}"]))
    assert summary["task"] == "spot" and summary["steps"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and {"reward/tool", "reward/format", "turns_mean", "tool_calls_mean"} <= set(lines[0])
