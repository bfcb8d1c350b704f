"""Prompt data: the math generator, JSONL / Parquet sources, shuffling, and iterator resume."""

import decimal
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.tiny_run import write_tokenizer

from fastrl_jax.config import load_config
from fastrl_jax.data import chat_prompts, math_problems, pipeline
from fastrl_jax.data.prompt_files import read_records
from fastrl_jax.data.prompts import record_prompt_ids
from fastrl_jax.rl import evaluate
from fastrl_jax.rl.rewards import correctness_reward


def test_math_problems_are_deterministic_and_graded():
    a = math_problems.problems(7, 50)
    assert a == math_problems.problems(7, 50)
    assert a != math_problems.problems(8, 50)
    assert {p.level for p in a} == set(math_problems.LEVELS)
    for p in a:
        assert isinstance(p.answer, int) and p.answer >= 0
        assert correctness_reward(f"The answer is {p.answer}.", str(p.answer)) == 1.0
    easy = math_problems.problems(7, 20, levels=(1,))
    assert all(p.level == 1 and p.answer <= 18 for p in easy)
    with pytest.raises(ValueError, match="levels"):
        math_problems.problem(0, 0, (9,))


def test_held_out_math_never_asks_a_training_question():
    """Levels 1 and 3 have 81 and 121 distinct questions, which any long training stream asks all of: the held-out
    questions (a fifth, by hash) are the held-out streams' alone, those of the trainer's evaluation included."""
    train = {p.question for seed in (0, 1) for p in math_problems.problems(seed, 2000, (1, 3))}
    held = {p.question for p in math_problems.problems(5, 200, (1, 3), held_out=True)}
    assert len(train) > 120 and len(held) > 30 and not train & held
    assert all(map(math_problems.is_held_out, held)) and not any(map(math_problems.is_held_out, train))
    cfg = load_config(None, ["data.math_levels=[1, 3]"])
    records = evaluate.held_out_records(cfg, 50)
    assert {r["level"] for r in records} == {1, 3} and not train & {r["prompt"] for r in records}
    assert math_problems.problems(5, 20, held_out=True) == math_problems.problems(5, 20, held_out=True)


def test_chat_stream_mixes_its_families_and_never_holds_a_held_out_prompt():
    a = chat_prompts.train_prompts(3, 500)
    assert a == chat_prompts.train_prompts(3, 500) and a != chat_prompts.train_prompts(4, 500)
    families = chat_prompts._families()
    for share, prompts in families:
        assert sum(p in set(prompts) for p in a) == round(500 * share)
    assert len(set(a)) == 500  # no repeats before a family is exhausted
    every = {p for _, prompts in families for p in prompts}
    assert not every & set(chat_prompts.held_out_prompts())
    assert len(chat_prompts.train_prompts(0, 7)) == 7 and chat_prompts.train_prompts(0, 0) == []


def test_math_answers_are_right():
    p = next(p for p in math_problems.problems(0, 100) if p.level == 3)
    a, b = (int(x) for x in p.question.removeprefix("What is ").rstrip("?").split(" * "))
    assert p.answer == a * b


def take(it, n):
    return [[r["prompt"] for r in next(it)] for _ in range(n)]


def test_iterator_resume_continues_exactly(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = pipeline.prompt_batches(pipeline.source(str(path), seed=0), batch_size=4, seed=3)
    it = pipeline.PromptIterator(ds)
    first = take(it, 2)
    state = json.loads(json.dumps(it.state()))  # saved as a JSON checkpoint item
    rest = take(it, 4)
    resumed = pipeline.PromptIterator(ds)
    resumed.restore(state)
    assert take(resumed, 4) == rest
    # shuffled, each epoch (2 batches of 4 of the 10 records) a new permutation whose last partial batch is left
    # out (verl's drop_last): no batch, nor epoch, holds a prompt twice (batches ran across epochs: '5', '3', '5')
    epochs = [[q for batch in (first + rest)[e:e + 2] for q in batch] for e in (0, 2, 4)]
    assert all(len(set(epoch)) == 8 for epoch in epochs) and len({tuple(epoch) for epoch in epochs}) == 3
    assert epochs[0] != [r["prompt"] for r in rows[:8]]
    other_seed = pipeline.PromptIterator(pipeline.prompt_batches(pipeline.source(str(path), seed=0), 4, seed=4))
    assert take(other_seed, 2) != first


def test_a_batch_reads_its_own_records_only():
    """grain's default iterator read 500 batches ahead on 16 threads: one batch of 64 math prompts generated
    32,064 problems beside the rollout loop (review)."""
    class Counting(pipeline.MathSource):
        reads = 0

        def __getitem__(self, index):
            Counting.reads += 1
            return super().__getitem__(index)

    it = pipeline.PromptIterator(pipeline.prompt_batches(Counting(0, (1,)), batch_size=64, seed=0))
    next(it)
    assert Counting.reads == 64


@pytest.mark.parametrize("spec", ["file", "math"])
def test_one_prompt_a_step(tmp_path, spec):
    """rl.prompts_per_step=1: grain sized the endless stream of 1-record batches at an int too large for an index."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    ds = pipeline.prompt_batches(pipeline.source(str(path) if spec == "file" else "math", seed=0), 1, seed=0)
    it = pipeline.PromptIterator(ds)
    assert [len(b) for b in take(it, 4)] == [1] * 4


def test_math_source_iterates_and_resumes():
    ds = pipeline.prompt_batches(pipeline.source("math", seed=5, levels=(1, 2)), batch_size=3, seed=5)
    it = pipeline.PromptIterator(ds)
    next(it)
    state = it.state()
    nxt = next(it)
    it2 = pipeline.PromptIterator(ds)
    it2.restore(state)
    assert next(it2) == nxt and all(r["level"] in (1, 2) for r in nxt)


def test_parquet_and_messages(tmp_path):
    path = tmp_path / "p.parquet"
    table = pa.table({"question": ["1+1?", "2+2?"], "gt": ["2", "4"]})
    pq.write_table(table, path)
    records = read_records(path, prompt_field="question", answer_field="gt")
    assert records == [{"answer": "2", "prompt": "1+1?"}, {"answer": "4", "prompt": "2+2?"}]
    msgs = tmp_path / "m.jsonl"
    msgs.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": 3}) + "\n")
    assert read_records(msgs) == [{"answer": "3", "messages": [{"role": "user", "content": "hi"}]}]


def test_bad_files_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl not found"):
        read_records(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"record 1 has no 'answer' \(absent or null"):
        read_records(bad)
    bad.write_text(json.dumps({"text": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="needs a 'prompt' string or a 'messages' list"):
        read_records(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1 is not valid JSON"):
        read_records(bad)
    bad.write_text(json.dumps({"messages": [{"content": "What is 2+2?"}], "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"record 1: each of 'messages' must be \{\"role\": str, \"content\": str\}"):
        read_records(bad)
    csv = tmp_path / "p.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="must be .jsonl, .json \\(an array\\) or .parquet"):
        read_records(csv)
    array = tmp_path / "p.json"  # a .json file is one array of records
    array.write_text(json.dumps([{"prompt": "1+1?", "answer": 2}]))
    assert read_records(array) == [{"answer": "2", "prompt": "1+1?"}]
    array.write_text(json.dumps({"prompt": "1+1?", "answer": 2}) + "\n")
    with pytest.raises(ValueError, match="must hold a JSON array of records, got dict"):
        read_records(array)


def test_prompt_files_keep_unicode_line_separators_and_check_ids(tmp_path):
    """JSON lines split at newlines only (U+2028 may sit inside a string), and prompt_ids must be token ids."""
    from fastrl_jax.data.prompt_files import read_prompt_file

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Line one\u2028still line one\x85"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_prompt_file(path, lambda text: [len(text)]) == [[len("Line one\u2028still line one\x85")]]
    for ids in ([1, [2, 3]], None, [1.9, True, "7"], [], [-1]):
        path.write_text(json.dumps({"prompt_ids": ids}) + "\n")
        with pytest.raises(ValueError, match="p.jsonl:1: prompt_ids must be a non-empty list of token ids|p.jsonl:1 needs"):
            read_prompt_file(path, lambda text: [])


def test_prompt_ids_instruction(tmp_path, caplog):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = record_prompt_ids({"prompt": "1+2=", "answer": "3"}, tok, instruction="ok", chat_template=True)
    assert tok.decode(ids) == "1+2= ok"  # no chat template on this tokenizer: plain text, and said once
    record_prompt_ids({"prompt": "2+2=", "answer": "4"}, tok, chat_template=True)
    assert caplog.text.count("has no chat template") == 1
    # The warning's advice, data.chat_template=false, silences it in every command's prompts: generate's, bench-sd's
    # and train-drafter's ignored it (review)
    from fastrl_jax.data.prompts import _without_template, chat_prompt_ids, read_jsonl_prompts

    _without_template.cache_clear()
    caplog.clear()
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "2+2="}) + "\n")
    assert read_jsonl_prompts(tmp_path / "p.jsonl", tok, chat_template=False) == [tok.encode("2+2=")]
    assert chat_prompt_ids(tok, "2+2=", chat_template=False) == tok.encode("2+2=")
    assert "has no chat template" not in caplog.text


def test_blank_answers_and_prompts_are_refused(tmp_path):
    """A blank ground truth names no answer (every completion would score 0, or an empty \\boxed{} would be
    rewarded), a blank prompt asks nothing: each fails at load with the record named, like a missing one."""
    bad = tmp_path / "blank.jsonl"
    for answer in ("", "   "):
        bad.write_text(json.dumps({"prompt": "q0", "answer": "1"}) + "\n" + json.dumps({"prompt": "q1", "answer": answer}) + "\n")
        with pytest.raises(ValueError, match="record 2: 'answer' is blank"):
            read_records(bad)
    bad.write_text(json.dumps({"prompt": " ", "answer": "1"}) + "\n")  # untemplated, it fails the step that draws it
    with pytest.raises(ValueError, match="record 1: 'prompt' is blank"):
        read_records(bad)


def test_verl_parquet_keeps_its_chat_in_the_prompt_field(tmp_path):
    """verl's RL parquet files hold the chat messages in "prompt" and the answer in reward_model.ground_truth."""
    path = tmp_path / "verl.parquet"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    pq.write_table(pa.Table.from_pylist([{"data_source": "gsm8k", "prompt": chat, "ability": "math",
                                          "reward_model": {"style": "rule", "ground_truth": "2"}}]), path)
    assert read_records(path, answer_field="reward_model.ground_truth") == [  # data_source for a verl compute_score
        {"answer": "2", "messages": chat, "data_source": "gsm8k"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"record 1: each of 'prompt' must be \{\"role\": str, \"content\": str\}"):
        read_records(bad)
    # Its plain question (extra_info.question), for data.instruction to apply: a dotted prompt_field too.
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps({"prompt": chat, "reward_model": {"ground_truth": "2"},
                                "extra_info": {"question": "1+1?"}}) + "\n")
    assert read_records(path, prompt_field="extra_info.question", answer_field="reward_model.ground_truth") == [
        {"answer": "2", "prompt": "1+1?", "extra_info": {"question": "1+1?"}}]
    # An SFT file's chat ends with the answer: as a prompt it would hand the policy its answer.
    bad.write_text(json.dumps({"messages": [*chat, {"role": "assistant", "content": "2"}], "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="record 1: 'messages' ends with an assistant turn"):
        read_records(bad)


def test_float_answers_are_written_out_as_numbers(tmp_path):
    """A float ground truth (a Parquet float column, a JSON number) reads as the digits, not Python's exponent form
    ('1e-05'), which no answer matches numerically."""
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": [1e-05, 2.5e16, 72.0]}), path)
    assert [r["answer"] for r in read_records(path)] == ["0.00001", "25000000000000000", "72.0"]
    assert correctness_reward("The answer is 0.00001", read_records(path)[0]["answer"]) == 1.0
    decimals = pa.array([decimal.Decimal("1E-7"), decimal.Decimal("12.50")], pa.decimal128(10, 8))
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": decimals}), path)  # a decimal column: '1.0E-7' (review)
    assert [r["answer"] for r in read_records(path)] == ["0.00000010", "12.50000000"]
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": pa.array([0.1, 1e-7], pa.float32())}), path)
    assert [r["answer"] for r in read_records(path)] == ["0.1", "0.0000001"]  # not 0.10000000149011612 (review)
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1.0, float("nan")]}), path)  # a missing value
    with pytest.raises(ValueError, match="record 2: 'answer' is nan, not an answer"):
        read_records(path)


def test_held_out_accuracy_that_holds_nothing_out_is_warned_before_loading(tmp_path, caplog):
    from fastrl_jax.rl.trainer import preflight

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    config = Path(__file__).resolve().parents[1] / "configs" / "smollm2_cpu.yaml"
    again = f"{tmp_path}/./train.jsonl"  # the same file by another name
    for eval_source, says in ((str(data), "the held-out accuracy scores questions the policy trains on"),
                              (again, "the held-out accuracy scores questions the policy trains on"),
                              ("math", "scored on the built-in math problems")):
        caplog.clear()
        preflight(load_config(config, [f"data.source={data}", f"data.eval_source={eval_source}", "rl.eval_every_steps=1"]), 1)
        assert says in caplog.text
    caplog.clear()
    preflight(load_config(config, [f"data.source={data}", "rl.eval_every_steps=0"]), 1)
    preflight(load_config(config, ["rl.eval_every_steps=1"]), 1)  # math against math: another seed's questions
    assert caplog.text == ""
