"""bert-finetune's extractive QA and token tagging: SQuAD's metric and seqeval's entity F1 against
hand-computed cases, answers mapped back through the tokenizer's offsets on the embedded QA
task, the families chosen from the files' layout, bad files refused in one line, and both
embedded tasks run from the CLI. The model is a 2-layer BERT of random weights with BERT's own
vocabulary (data_prep/resources), saved as Hugging Face saves one: these tests are about the
plumbing, and need no pretraining run."""
import json
import subprocess
import sys

import pytest
from conftest import REPO, refusal

from commodity_bert.finetune import qa, tagging
from commodity_bert.finetune.cli import main as finetune_main

QUICK = ["--seeds", "1", "--epochs", "1", "--min-steps", "0", "--lr", "1e-3", "--batch-size", "16", "--quiet",
         "--threads", "1", "--no-cache"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast
    out = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = BertTokenizerFast(vocab=str(REPO / "data_prep" / "resources" / "bert_base_uncased_vocab.txt"),
                                  do_lower_case=True)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertForMaskedLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "commodity_bert.finetune", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)


# ---- the metrics, by hand

def test_squad_exact_match_and_f1_equal_a_hand_computation():
    assert qa.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"  # punctuation goes, articles and spaces too
    assert qa.exact_match("the Eiffel Tower.", "Eiffel Tower") == 1.0
    # "in 1889 in paris" against "1889": 1 common word of 4 predicted, of 1 gold: P 1/4, R 1, F1 2/5
    assert qa.f1("in 1889 in Paris", "1889") == pytest.approx(0.4)
    assert qa.f1("Paris", "1889") == 0.0
    # repeated words count as often as both sides have them: "x y y" vs "y y z" → 2 common, P 2/3, R 2/3
    assert qa.f1("x y y", "y y z") == pytest.approx(2 / 3)
    question = qa.Question("q", "When?", "Built in 1889 in Paris.", [("1889", 9), ("in 1889", 6)])
    # each question's best gold answer: EM from "in 1889", F1 likewise
    assert qa.score(["in 1889"], [question]) == {"exact_match": 1.0, "f1": 1.0}
    # "1889 in paris": against "1889" P 1/3 R 1 (F1 1/2), against "in 1889" P 2/3 R 1 (F1 4/5): the best, 4/5;
    # "Paris": 0; the mean over the two questions: 2/5
    assert qa.score(["1889 in Paris", "Paris"], [question, question]) == pytest.approx(
        {"exact_match": 0.0, "f1": (0.8 + 0.0) / 2})


def test_entity_f1_counts_whole_spans_as_conlleval_does():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    assert tagging.entity_f1(gold, gold) == 1.0
    # one of three entities missed, none wrong: P 1, R 2/3
    assert tagging.entity_f1(gold, [["B-PER", "I-PER", "O", "O"], ["B-ORG", "O"]]) == pytest.approx(0.8)
    # a span cut short is wrong as a whole (no credit per token): P 2/3 R 2/3
    assert tagging.entity_f1(gold, [["B-PER", "O", "O", "B-LOC"], ["B-ORG", "O"]]) == pytest.approx(2 / 3)
    # conlleval's reading: an I- after O begins an entity, so IOB1's I-PER I-PER is the PER span
    assert tagging.entity_f1(gold, [["I-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]) == 1.0
    # the right span with the wrong type is wrong: P 2/3 R 2/3
    assert tagging.entity_f1(gold, [["B-ORG", "I-ORG", "O", "B-LOC"], ["B-ORG", "O"]]) == pytest.approx(2 / 3)


# ---- answers back to text

def test_windows_hold_each_answer_and_the_offsets_cut_it_back_out(tiny):
    """Every window that holds an answer points at tokens whose offsets cut the answer's text back
    out of the context (more only where the answer begins or ends inside a word: "£20,980" for
    "20,980"); each question's answer is in at least one window; and each question's gold tokens,
    given as the model's logits, come back as its answer through the prediction code the
    fine-tuning uses."""
    import numpy as np
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    questions = qa.EMBEDDED["embedded:squad"]().dev
    windows = qa.windows(questions, tokenizer, 64, qa.stride_for(64, None))
    assert len(windows.input_ids) > 2 * len(questions)  # long contexts were split
    assert max(len(ids) for ids in windows.input_ids) == 64
    held, exact = set(), 0
    for w, (start, end) in enumerate(zip(windows.starts, windows.ends)):
        if start == 0:
            continue
        q = windows.questions[windows.question_of[w]]
        at, text = q.answers[0][1], q.answers[0][0]
        first, last = windows.offsets[w][start][0], windows.offsets[w][end][1]
        assert first <= at and at + len(text) <= last, (q.id, q.context[first:last], text)  # holds it...
        assert last - first <= len(text) + 8, (q.id, q.context[first:last], text)  # ...and little more
        exact += q.context[first:last] == text
        held.add(windows.question_of[w])
    assert len(held) == len(questions)
    assert exact >= 0.97 * sum(s > 0 for s in windows.starts)
    best = {}
    for w, (start, end) in enumerate(zip(windows.starts, windows.ends)):
        starts, ends = np.zeros(64), np.zeros(64)
        starts[start], ends[end] = 10.0, 10.0
        span = qa.best_span(starts, ends, windows.offsets[w])
        q = windows.question_of[w]
        if span is not None and (q not in best or span[0] > best[q][0]):
            best[q] = (span[0], windows.offsets[w][span[1]][0], windows.offsets[w][span[2]][1])
    scores = qa.score([questions[q].context[best[q][1]:best[q][2]] for q in range(len(questions))], questions)
    assert scores["exact_match"] >= 0.97 and scores["f1"] >= 0.98, scores


# ---- the family from the layout, and bad files

def squad_file(path, questions):
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": q.context, "qas": [{"id": q.id, "question": q.question,
                                        "answers": [{"text": t, "answer_start": s} for t, s in q.answers]}]}
        for q in questions]}]}, indent=1))
    return path


def conll_file(path, sentences):
    path.write_text("-DOCSTART- -X- O\n\n" + "".join(
        "".join(f"{w} X {t}\n" for w, t in zip(words, tags)) + "\n" for words, tags in zip(*sentences)))
    return path


def test_bad_qa_and_tagging_files_get_one_line_naming_file_and_line(tmp_path, tiny, capsys):
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "Built in 1889 in Paris.", "qas": [
        {"id": "ok", "question": "Where?", "answers": [{"text": "Paris", "answer_start": 17}]}]}]}]}))
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps({"data": [{"paragraphs": [{"context": "Built in 1889 in Paris.", "qas": [
        {"id": "ok", "question": "Where?", "answers": [{"text": "Paris", "answer_start": 17}]},
        {"id": "off", "question": "When?", "answers": [{"text": "1889", "answer_start": 0}]}]}]}]}, indent=1))
    off_line = next(n for n, line in enumerate(moved.read_text().splitlines(), 1) if '"off"' in line)
    good = conll_file(tmp_path / "good.conll", ([["John", "lives", "in", "Rome"]], [["B-PER", "O", "O", "B-LOC"]]))
    bioes = conll_file(tmp_path / "bioes.conll", ([["John", "lives"]], [["S-PER", "O"]]))
    ragged = tmp_path / "ragged.conll"
    ragged.write_text("John X B-PER\nlives X O\nNew York X B-LOC\n")
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps({"tokens": ["a", "b"], "tags": ["O", "O"]}) + "\n" +
                     json.dumps({"tokens": ["a", "b"], "tags": ["O"]}) + "\n")
    cases = {
        "answer not at its offset": ([moved, squad], f"{moved}: line {off_line}: question 'off': the answer '1889' is "
                                                     f"not at answer_start 0"),
        "tag outside BIO": ([bioes, good], f"{bioes}: line 3: tag 'S-PER' is not BIO"),
        "ragged columns": ([ragged, good], f"{ragged}: line 3 has 4 columns, the file's first line 3"),
        "tokens and tags differ": ([jsonl, good], f"{jsonl}: line 2: 'tokens' and 'tags' must be lists of one length"),
        "classification flag on QA": ([squad, squad, "--positive-label", "x"], "--positive-label is for classification"),
    }
    for case, ((train, dev, *more), expected) in cases.items():
        args = ["--model", tiny, "--train", train, "--validation", dev, *more, *QUICK, "--json", tmp_path / "o.json"]
        # through the console script once, the rest in process
        code, stderr = refusal(finetune_main, args, capsys,
                               "commodity_bert.finetune" if case == "answer not at its offset" else None)
        assert code == 2, (case, stderr[-2000:])
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("bert-finetune: error: "), (case, stderr)
        assert expected in lines[0], (case, lines[0])
    assert not (tmp_path / "o.json").exists()  # nothing written


def test_the_family_follows_the_files_layout(tmp_path):
    squad = squad_file(tmp_path / "train.json", [qa.Question("a", "Where?", "In Paris.", [("Paris", 3)])])
    rows = tmp_path / "squad_rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "question": "Where?", "context": "In Paris.",
                                "answers": {"text": ["Paris"], "answer_start": [3]}}) + "\n")
    tags = tmp_path / "tags.jsonl"
    tags.write_text(json.dumps({"tokens": ["In", "Paris"], "tags": ["O", "B-LOC"]}) + "\n")
    conll = conll_file(tmp_path / "dev.conll", ([["In", "Paris"]], [["O", "B-LOC"]]))
    sentences = tmp_path / "sentences.jsonl"
    sentences.write_text(json.dumps({"text": "In Paris", "label": "x"}) + "\n")
    assert qa.is_squad(squad) and qa.is_squad(rows) and not qa.is_squad(tags) and not qa.is_squad(sentences)
    assert tagging.is_tagging(tags) and tagging.is_tagging(conll) and not tagging.is_tagging(rows)
    assert not tagging.is_tagging(sentences)
    assert qa.read_questions(rows, "train")[0] == qa.read_questions(squad, "train")[0]
    # SQuAD v1.1's own dev file has answers one character off their offset, a space before the text:
    # moved onto the text and counted, as far as REALIGN_CHARS; further off is an error (the test above)
    quirk = squad_file(tmp_path / "quirk.json", [qa.Question("q", "When?", "Built in 1889, in Paris.",
                                                             [(" 1889", 7)])])
    moved: list = []
    assert qa.read_questions(quirk, "train", moved)[0][0].answers == [("1889", 9)] and moved == ["q"]


# ---- both families from the CLI, on their embedded tasks

def test_embedded_qa_and_tagging_run_from_the_cli(tmp_path, tiny, capsys):
    """One seed each, a few steps, from random weights beside "pretrained" random weights: the
    plumbing and the result object, not the scores."""
    out = {}
    for name in ("embedded:squad", "embedded:entities"):
        json_out = tmp_path / f"{name.split(':')[1]}.json"
        finetune_main(["--model", str(tiny), "--task", name, "--train-examples", "64", "--max-seq-len", "64",
                       "--random-init", *QUICK, "--json", str(json_out)])
        out[name] = json.loads(json_out.read_text())
    report = capsys.readouterr().out
    squad, ner = out["embedded:squad"], out["embedded:entities"]
    assert squad["family"] == "qa" and squad["metric"] == "f1" and squad["train_size"] == 64
    assert 0 <= squad["exact_match"]["median"] <= squad["median"] <= 1
    assert squad["sliding_window"]["value"] > 0.05  # word overlap finds some answers
    assert ner["family"] == "tagging" and ner["metric"] == "f1" and ner["train_size"] == 64
    sampled = tagging.sample_train(tagging.embedded_entities(), 64)
    assert ner["majority_tag"]["value"] == tagging.majority_tags(sampled)["value"] > 0
    assert ner["random_init"]["per_seed"] and ner["dev_size"] == 2077
    assert "sliding window" in report and "majority tag" in report and "exact match" in report
    from commodity_bert.finetune.table import table  # recipes/evaluate.sh's table: a row per family
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table([squad, ner]).splitlines()}
    assert f"| qa | f1 (exact match {100 * squad['exact_match']['median']:.1f}) |" in rows["embedded:squad"]
    assert f"| {100 * squad['sliding_window']['value']:.1f} (sliding window) |" in rows["embedded:squad"]
    assert f"| {100 * ner['majority_tag']['value']:.1f} (majority tag) |" in rows["embedded:entities"]


def test_a_users_squad_and_conll_files_run_and_write_their_text(tmp_path, tiny, capsys):
    """The same families from files a user brings (SQuAD's JSON, CoNLL columns), and
    --write-train-text of each: the training split's contexts or sentences, never dev's."""
    squad, entities = qa.embedded_squad(), tagging.embedded_entities()
    (tmp_path / "squad").mkdir()
    train_json = squad_file(tmp_path / "squad" / "train.json", squad.train[:40])
    dev_json = squad_file(tmp_path / "squad" / "dev.json", squad.dev[:20])
    train_conll = conll_file(tmp_path / "train.conll", (entities.train.words[:40], entities.train.tags[:40]))
    dev_conll = conll_file(tmp_path / "dev.conll", (entities.dev.words[:20], entities.dev.tags[:20]))
    for train, dev, family in ((train_json, dev_json, "qa"), (train_conll, dev_conll, "tagging")):
        out = tmp_path / f"{family}.json"
        finetune_main(["--model", str(tiny), "--train", str(train), "--validation", str(dev), "--max-seq-len", "64",
                       *QUICK, "--json", str(out)])
        result = json.loads(out.read_text())
        assert (result["family"], result["train_size"], result["dev_size"]) == (family, 40, 20), result
        assert result["task"] == ("squad" if family == "qa" else tmp_path.name)  # a train.* file: its folder
    text = tmp_path / "squad.txt"
    finetune_main(["--task", "embedded:squad", "--write-train-text", str(text)])
    documents = text.read_text().split("\n\n")[:-1]
    contexts = {" ".join(q.context.split()) for q in squad.train}
    assert len(documents) == len(contexts) and set(documents) == contexts
    assert not contexts & {" ".join(q.context.split()) for q in squad.dev}
    capsys.readouterr()


def test_a_toy_family_registered_here_runs_through_bert_finetune(tmp_path, tiny, capsys):
    """A family defined in this test and registered through families.register_family alone: --family
    names it, its reader reads its own files, its flags' refusal, report lines and table cell are
    its own; the fine-tuning itself reuses classification's hooks."""
    from commodity_bert.finetune import tasks
    from commodity_bert.finetune.families import FAMILIES, Family, register_family
    from commodity_bert.finetune.table import table

    class ToyTask(tasks.Task):
        family = "toy"

    def read(args):  # a line each: "label<TAB>text"
        def split(path):
            rows = [line.split("\t", 1) for line in path.read_text().splitlines() if line]
            return tasks.Split([text for _, text in rows], [label for label, _ in rows])
        task = tasks.finish("toy", "accuracy", split(args.train), split(args.validation), args.train, args.validation)
        return ToyTask(**vars(task))

    def length_rule(pretrained, task, train, dev, *rest) -> dict:  # the toy's baseline: "long" above 5 words
        guesses = ["long" if len(text.split()) > 5 else "short" for text in task.dev.texts]
        return {"length_rule": {"value": sum(g == y for g, y in zip(guesses, task.dev.labels)) / len(guesses)}}

    words = "the cat sat on a mat by the door of an old red house".split()
    for name, size in (("train", 96), ("dev", 32)):
        lines = [f"{'long' if i % 2 else 'short'}\t{' '.join(words[: 9 if i % 2 else 3])}" for i in range(size)]
        (tmp_path / f"{name}.toy").write_text("\n".join(lines) + "\n")
    classification = FAMILIES["classification"]
    register_family(Family(
        "toy", "the toy family", classification.encode, classification.finetune, length_rule, from_files=read,
        sample_train=tasks.sample_train, units="lines",
        head=lambda hp: "mean pooling (toy)", report_lines=lambda r: [f"length rule {100 * r['length_rule']['value']:.1f}%"],
        no_model_baseline=lambda r: (r["length_rule"]["value"], "length rule"), task_type="toy-classification"))
    try:
        args = ["--model", tiny, "--train", tmp_path / "train.toy", "--validation", tmp_path / "dev.toy",
                "--family", "toy", *QUICK, "--json", tmp_path / "toy.json"]
        finetune_main([str(a) for a in args])
        out = capsys.readouterr().out
        assert "toy (toy): accuracy on 32 dev lines (96 train)" in out and "mean pooling (toy)" in out, out
        assert "length rule 100.0%" in out, out
        result = json.loads((tmp_path / "toy.json").read_text())
        assert result["family"] == "toy" and result["task_type"] == "toy-classification" and 0 <= result["median"] <= 1
        assert "| toy | toy | accuracy | 32 |" in table([result]) and "100.0 (length rule)" in table([result])
        code, stderr = refusal(finetune_main, [str(a) for a in args[:-2]] + ["--stride", "8"], capsys)
        assert code == 2 and "--stride is for extractive QA; this task is toy" in stderr, stderr
    finally:
        FAMILIES.pop("toy")
