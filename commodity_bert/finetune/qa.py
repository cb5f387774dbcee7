"""Extractive question answering, SQuAD's way: a question and a context in, the answer a span
of the context.

- **Input**: SQuAD v1.1's JSON (`data` → `paragraphs` → `context`, `qas` → `id`, `question`,
  `answers` [{`text`, `answer_start`}]), or the flattened rows Hugging Face's `squad` data set
  has (JSONL or a `save_to_disk` directory: `id`, `question`, `context`, `answers` {`text`: [...],
  `answer_start`: [...]}). Every answer must read, at its offset, as its text. SQuAD v2's
  unanswerable questions are left out and counted (`source.unanswerable_left_out`).
- **Windows**: a context longer than the sequence is split into overlapping windows (the fast
  tokenizer's `stride`: tokens two neighbouring windows share), each `[CLS] question [SEP]
  context part [SEP]`; questions longer than half the sequence keep their first half. A
  training window that holds the whole answer points at its first and last token; one that
  does not points at [CLS] (BERT's run_squad and Hugging Face's run_qa do the same).
- **Answers back to text**: the tokenizer's character offsets. A question's answer is the best
  span (start logit + end logit, start ≤ end, at most MAX_ANSWER_TOKENS tokens, inside the
  context) over all its windows, cut from the context at those offsets.
- **Metric**: exact match and F1 over the answer's words after SQuAD's normalisation (lower
  case, no punctuation, no articles, single spaces), the best over the question's gold answers,
  as SQuAD v1.1's official script computes them (written out below: 30 lines, no dependency);
  F1 is the family's main metric (`median`).
- **The no-model baseline**: a sliding window (after Rajpurkar et al. 2016's sliding-window
  baseline): the span of k context words whose surrounding w words share the most words with
  the question, k and w chosen on the training questions, never on dev. It is to QA what the
  bag of words is to classification: what word overlap alone answers.
"""
from __future__ import annotations

import json
import re
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from commodity_bert.finetune import trainer
from commodity_bert.finetune.families import Family, register_family
from commodity_bert.finetune.tasks import TaskError, first_row_keys, name_of, read_records, sampled_rows

MAX_ANSWER_TOKENS = 30  # BERT's run_squad: max_answer_length
BEST_STARTS = 20  # starts and ends tried per window (run_squad's n_best_size)


@dataclass
class Question:
    id: str
    question: str
    context: str
    answers: list[tuple[str, int]]  # (text, character offset); training uses the first


@dataclass
class QATask:
    name: str
    train: list[Question]
    dev: list[Question]
    source: dict = field(default_factory=dict)
    family = "qa"
    metric = "f1"
    label_names: tuple = ()


# ---------------------------------------------------------------- reading

def _line_of(text: str, needle: str) -> int | None:
    at = text.find(needle)
    return None if at < 0 else text.count("\n", 0, at) + 1


REALIGN_CHARS = 2  # an answer this close to its offset is moved onto it: SQuAD v1.1's own dev file needs it


def _checked(question: Question, path: Path, role: str, where: str, realigned: list) -> Question:
    """The question with each answer at its offset. SQuAD v1.1's official dev set has 15
    answers whose offset is one character off (most with a space before the text, ' 23–16'):
    an answer whose stripped text starts within REALIGN_CHARS of its offset is moved there and
    counted (BERT's run_squad skipped such answers); anything further is an error."""
    if not question.question.strip():
        raise TaskError(f"--{role} {path}: {where}question {question.id!r} has no question text")
    answers = []
    for text, start in question.answers:
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise TaskError(f"--{role} {path}: {where}question {question.id!r}: answer_start {start!r} is not an "
                            f"offset into its context")
        found = question.context[start:start + len(text)]
        if found != text:
            stripped = text.strip()
            near = question.context.find(stripped, max(0, start - REALIGN_CHARS))
            if not stripped or near < 0 or near > start + len(text) - len(text.lstrip()) + REALIGN_CHARS:
                raise TaskError(f"--{role} {path}: {where}question {question.id!r}: the answer {text!r} is not at "
                                f"answer_start {start} of its context (it reads {found!r} there); fix answer_start")
            text, start = stripped, near
            realigned.append(question.id)
        answers.append((text, start))
    question.answers = answers
    return question


def _from_squad_json(path: Path, role: str, realigned: list) -> tuple[list[Question], int]:
    text = path.read_text(encoding="utf-8-sig")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskError(f"--{role} {path}: line {exc.lineno} is not JSON ({exc.msg})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise TaskError(f"--{role} {path}: not SQuAD's layout (a JSON object whose 'data' lists articles)")
    questions, unanswerable = [], 0
    for a, article in enumerate(doc["data"]):
        for p, paragraph in enumerate(article.get("paragraphs", []) if isinstance(article, dict) else []):
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not context:
                raise TaskError(f"--{role} {path}: article {a + 1}, paragraph {p + 1} has no 'context'")
            for q in paragraph.get("qas", []):
                qid = str(q.get("id", f"article {a + 1}, paragraph {p + 1}"))
                line = _line_of(text, f'"{qid}"') if "id" in q else None
                where = f"line {line}: " if line else ""
                answers = q.get("answers") or []
                if q.get("is_impossible") or not answers:
                    unanswerable += 1
                    continue
                try:
                    pairs = [(str(x["text"]), x["answer_start"]) for x in answers]
                except (TypeError, KeyError) as exc:
                    raise TaskError(f"--{role} {path}: {where}question {qid!r}: each answer needs 'text' and "
                                    f"'answer_start'") from exc
                questions.append(_checked(Question(qid, str(q.get("question", "")), context, pairs), path, role,
                                          where, realigned))
    return questions, unanswerable


def _from_rows(rows: list[dict], path: Path, role: str, realigned: list) -> tuple[list[Question], int]:
    """Hugging Face's flattened squad rows (a JSONL line or a saved data set's row each)."""
    questions, unanswerable = [], 0
    for number, row in enumerate(rows, 1):
        missing = [k for k in ("question", "context", "answers") if k not in row]
        if missing:
            raise TaskError(f"--{role} {path}: row {number} has no '{missing[0]}' (SQuAD rows need id, question, "
                            f"context and answers)")
        answers = row["answers"]
        if not isinstance(answers, dict) or not isinstance(answers.get("text"), list) \
                or len(answers.get("answer_start", [])) != len(answers["text"]):
            raise TaskError(f"--{role} {path}: row {number}: 'answers' must be {{\"text\": [...], \"answer_start\": "
                            f"[...]}} of one length")
        if not answers["text"]:
            unanswerable += 1
            continue
        pairs = list(zip(map(str, answers["text"]), answers["answer_start"]))
        questions.append(_checked(Question(str(row.get("id", number)), str(row["question"]), str(row["context"]),
                                           pairs), path, role, f"row {number}: ", realigned))
    return questions, unanswerable


def read_questions(path: Path, role: str, realigned: list | None = None) -> tuple[list[Question], int]:
    """(the answerable questions, how many unanswerable ones were left out); the ids of answers
    moved onto their offset are appended to `realigned`."""
    realigned = [] if realigned is None else realigned
    if not path.exists():
        raise TaskError(f"--{role} {path}: no such file")
    if path.is_file() and path.suffix.lower() == ".json":
        questions, unanswerable = _from_squad_json(path, role, realigned)
    else:
        questions, unanswerable = _from_rows(read_records(path, role), path, role, realigned)
    if not questions:
        raise TaskError(f"--{role} {path}: no answerable questions")
    return questions, unanswerable


def is_squad(path: Path) -> bool:
    """Whether a --train file is in one of the layouts above (the CLI picks the family so)."""
    if path.is_file() and path.suffix.lower() == ".json":
        try:
            with open(path, encoding="utf-8-sig") as fh:
                head = fh.read(4096)
        except (OSError, UnicodeDecodeError):
            return False
        return head.lstrip().startswith("{") and '"data"' in head and '"paragraphs"' in head
    return {"question", "context", "answers"} <= first_row_keys(path)


def from_files(train_path: Path, dev_path: Path) -> QATask:
    realigned: list = []
    train, left_train = read_questions(train_path, "train", realigned)
    dev, left_dev = read_questions(dev_path, "validation", realigned)
    return QATask(name_of(train_path), train, dev, {"train": str(train_path), "validation": str(dev_path),
                                     "unanswerable_left_out": left_train + left_dev,
                                     "answers_realigned": len(realigned)})


def sample_train(task: QATask, n: int) -> QATask:
    """`n` training questions (tasks.sampled_rows)."""
    rows, record = sampled_rows(len(task.train), n, "questions")
    return QATask(task.name, [task.train[i] for i in rows], task.dev, {**task.source, "train_examples": record})


# ---------------------------------------------------------------- SQuAD v1.1's metric

def normalize_answer(text: str) -> str:
    """SQuAD v1.1's normalisation: lower case, punctuation and the articles a/an/the removed,
    whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    predicted, truth = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(predicted) & Counter(truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def score(predictions: list[str], questions: list[Question]) -> dict:
    """{'exact_match', 'f1'} as fractions: each question's best over its gold answers, averaged."""
    em = [max(exact_match(p, text) for text, _ in q.answers) for p, q in zip(predictions, questions)]
    f = [max(f1(p, text) for text, _ in q.answers) for p, q in zip(predictions, questions)]
    return {"exact_match": float(np.mean(em)), "f1": float(np.mean(f))}


# ---------------------------------------------------------------- windows

@dataclass
class Windows:
    """A split's questions and their windows: the token ids of each window, the question it
    belongs to, each token's character span in the context (None outside it), and for training
    the answer's first and last token (0, 0: not in this window)."""
    questions: list[Question]
    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    question_of: list[int]
    offsets: list[list[tuple[int, int] | None]]
    starts: list[int]
    ends: list[int]

    def __len__(self) -> int:  # questions: what selection's slice and --train-examples count
        return len(self.questions)

    @property
    def labels(self) -> list[int]:  # one stratum: selection.held_out_slice stratifies by label
        return [0] * len(self.questions)

    def subset(self, rows: list[int]) -> Windows:
        new_index = {q: i for i, q in enumerate(rows)}
        keep = [w for w, q in enumerate(self.question_of) if q in new_index]
        return Windows([self.questions[q] for q in rows], *([getattr(self, name)[w] for w in keep] for name in
                       ("input_ids", "token_type_ids")), [new_index[self.question_of[w]] for w in keep],
                       [self.offsets[w] for w in keep], [self.starts[w] for w in keep], [self.ends[w] for w in keep])


def stride_for(max_seq_len: int, stride: int | None) -> int:
    """The tokens two windows share: given, or a quarter of the sequence; always less than the
    context's room beside a question of half the sequence."""
    room = max_seq_len - max_seq_len // 2 - 3
    if room < 8:
        raise TaskError(f"--max-seq-len {max_seq_len}: too short for a question and a context; give 32 or more")
    chosen = max_seq_len // 4 if stride is None else stride
    if not 0 <= chosen < room:
        raise TaskError(f"--stride {chosen}: give 0 to {room - 1} tokens for --max-seq-len {max_seq_len}")
    return chosen


def _short_questions(questions: list[Question], tokenizer, limit: int) -> list[str]:
    """Each question, cut after its first `limit` tokens where longer (run_squad's max_query_length)."""
    texts = [q.question.strip() for q in questions]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [text if len(offsets) <= limit else text[:offsets[limit - 1][1]]
            for text, offsets in zip(texts, enc["offset_mapping"])]


def windows(questions: list[Question], tokenizer, max_seq_len: int, stride: int) -> Windows:
    if not getattr(tokenizer, "is_fast", False):
        raise TaskError("extractive QA needs a fast tokenizer (its character offsets); save the model's "
                        "tokenizer with tokenizers' tokenizer.json")
    enc = tokenizer(_short_questions(questions, tokenizer, max_seq_len // 2), [q.context for q in questions],
                    truncation="only_second", max_length=max_seq_len, stride=stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True, return_token_type_ids=True)
    out = Windows(questions, [], [], [], [], [], [])
    for w, ids in enumerate(enc["input_ids"]):
        q = enc["overflow_to_sample_mapping"][w]
        sequence = enc.sequence_ids(w)
        offsets = [tuple(o) if s == 1 else None for o, s in zip(enc["offset_mapping"][w], sequence)]
        context_tokens = [t for t, o in enumerate(offsets) if o is not None]
        text, start_char = questions[q].answers[0]
        end_char = start_char + len(text)
        first, last = context_tokens[0], context_tokens[-1]
        start = end = 0
        if offsets[first][0] <= start_char and offsets[last][1] >= end_char:
            start = max(t for t in context_tokens if offsets[t][0] <= start_char)
            end = min(t for t in context_tokens if offsets[t][1] >= end_char)
        out.input_ids.append(ids)
        out.token_type_ids.append(enc["token_type_ids"][w])
        out.question_of.append(q)
        out.offsets.append(offsets)
        out.starts.append(start)
        out.ends.append(end)
    return out


def encode(task: QATask, tokenizer, hp, cache_dir=None) -> tuple[Windows, Windows, bool]:
    stride = stride_for(hp.max_seq_len, hp.stride)
    return windows(task.train, tokenizer, hp.max_seq_len, stride), windows(task.dev, tokenizer, hp.max_seq_len,
                                                                            stride), False


# ---------------------------------------------------------------- the model

def span_model(pretrained, random_init: bool, hp):
    """Hugging Face's BertForQuestionAnswering (a linear layer giving each token a start and an
    end logit) over the pretrained encoder."""
    from transformers import BertForQuestionAnswering

    from commodity_bert.finetune import models
    model = BertForQuestionAnswering(models.task_config(pretrained, 2, hp.dropout))
    return models.with_encoder(model, pretrained, random_init, hp.reinit_layers)


def best_span(start_logits: np.ndarray, end_logits: np.ndarray, offsets: list) -> tuple[float, int, int] | None:
    """(score, first token, last token) of the window's best span inside the context, or None."""
    starts = [t for t in np.argsort(-start_logits)[:BEST_STARTS] if t < len(offsets) and offsets[t] is not None]
    ends = [t for t in np.argsort(-end_logits)[:BEST_STARTS] if t < len(offsets) and offsets[t] is not None]
    best = None
    for s in starts:
        for e in ends:
            if s <= e < s + MAX_ANSWER_TOKENS:
                value = float(start_logits[s] + end_logits[e])
                if best is None or value > best[0]:
                    best = (value, int(s), int(e))
    return best


def predict(model, data: Windows, hp, pad_id: int, device) -> list[str]:
    """Each question's answer text: its best span over all its windows."""
    best: list = [None] * len(data.questions)
    order = sorted(range(len(data.input_ids)), key=lambda w: -len(data.input_ids[w]))
    model.eval()
    with torch.no_grad(), trainer.autocast(device, hp.precision):
        for at in range(0, len(order), hp.batch_size * 2):
            rows = order[at:at + hp.batch_size * 2]
            out = model(**trainer.padded(data, rows, pad_id, device))
            starts, ends = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
            for r, w in enumerate(rows):
                span = best_span(starts[r], ends[r], data.offsets[w])
                q = data.question_of[w]
                if span is not None and (best[q] is None or span[0] > best[q][0]):
                    best[q] = (span[0], data.offsets[w][span[1]][0], data.offsets[w][span[2]][1])
    return ["" if b is None else data.questions[q].context[b[1]:b[2]] for q, b in enumerate(best)]


def finetune(pretrained, task: QATask, train: Windows, dev: Windows, seed: int, hp, device,
             random_init: bool = False, progress: bool = True, label: str | None = None) -> dict:
    started = time.perf_counter()
    trainer.seed_everything(seed)
    model = span_model(pretrained, random_init, hp).to(device)
    pad_id = pretrained.tokenizer.pad_token_id or 0
    total = trainer.total_steps(len(train.input_ids), hp)  # steps count windows, as run_squad's epochs do

    def loss_of(rows):
        batch = trainer.padded(train, rows, pad_id, device)
        with trainer.autocast(device, hp.precision):
            out = model(**batch)
        start = torch.tensor([train.starts[w] for w in rows], device=device)
        end = torch.tensor([train.ends[w] for w in rows], device=device)
        return (torch.nn.functional.cross_entropy(out.start_logits.float(), start) +
                torch.nn.functional.cross_entropy(out.end_logits.float(), end)) / 2
    losses = trainer.fit(model, [len(ids) for ids in train.input_ids], loss_of, total, seed, hp, progress,
                         label or f"seed {seed}")
    scores = score(predict(model, dev, hp, pad_id, device), dev.questions)
    return {"seed": seed, "value": scores["f1"], "exact_match": scores["exact_match"],
            "seconds": round(time.perf_counter() - started, 2), "steps": total, "lr": hp.lr,
            "final_train_loss": float(np.mean(losses[-20:])) if losses else None}


# ---------------------------------------------------------------- the no-model baseline

STOPWORDS = frozenset("a an the of to in on at by for with from and or is are was were be been what which who whom "
                      "whose when where why how did do does that this these those it its as".split())
WINDOW_SPANS = (1, 2, 3, 4)  # answer words tried
WINDOW_WIDTHS = (3, 6, 12)  # words on each side that must share the question's words


def _words(text: str) -> list[tuple[str, int, int]]:
    """(normalised word, start, end) of each whitespace word of `text`."""
    out = []
    for m in re.finditer(r"\S+", text):
        word = normalize_answer(m.group())
        if word:
            out.append((word, m.start(), m.end()))
    return out


def window_answer(question: Question, span: int, width: int) -> str:
    """The span of `span` context words, none of them a question word, whose `width` words on
    each side share the most (non-stopword) words with the question; the first such span on a tie."""
    asked = {w for w, *_ in _words(question.question)} - STOPWORDS
    words = _words(question.context)
    best, answer = -1, ""
    for i in range(len(words) - span + 1):
        inside = words[i:i + span]
        if any(w in asked for w, *_ in inside):
            continue
        around = {w for w, *_ in words[max(0, i - width):i] + words[i + span:i + span + width]}
        overlap = len(around & asked)
        if overlap > best:
            best, answer = overlap, question.context[inside[0][1]:inside[-1][2]]
    return answer


def sliding_window(task: QATask) -> dict:
    """The span length and width with the best F1 on (up to 1,000) training questions, scored on dev."""
    fit = task.train[:1000]
    trials = {(k, w): score([window_answer(q, k, w) for q in fit], fit)["f1"] for k in WINDOW_SPANS
              for w in WINDOW_WIDTHS}
    k, w = max(trials, key=lambda key: (trials[key], -key[0], -key[1]))
    scores = score([window_answer(q, k, w) for q in task.dev], task.dev)
    return {"value": scores["f1"], "exact_match": scores["exact_match"], "span_words": k, "width": w}


def baselines(task: QATask, train: Windows, dev: Windows) -> dict:
    return {"sliding_window": sliding_window(task)}


# ---------------------------------------------------------------- the embedded task

SQUAD_SOURCE = Path(__file__).resolve().parent / "resources" / "squad_v1.1_dev_7_articles.json.xz"
SQUAD_DEV_ARTICLES = ("Teacher", "Southern_California")  # the rest train: no article on both sides


def embedded_squad() -> QATask:
    """Extractive QA on 7 Wikipedia articles of SQuAD v1.1's dev set (resources/README.md):
    5 articles train (1,877 questions), 2 are dev (448, each with SQuAD's three gold answers)."""
    import lzma
    try:
        with lzma.open(SQUAD_SOURCE, "rt", encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskError(f"--task embedded:squad: its data {SQUAD_SOURCE} is missing or damaged ({exc}); reinstall "
                        f"the commodity-bert package (pip install -e .)") from exc
    realigned: list = []
    splits: dict[bool, list[Question]] = {False: [], True: []}
    for article in doc["data"]:
        for paragraph in article["paragraphs"]:
            for q in paragraph["qas"]:
                question = Question(q["id"], q["question"], paragraph["context"],
                                    [(a["text"], a["answer_start"]) for a in q["answers"]])
                splits[article["title"] in SQUAD_DEV_ARTICLES].append(
                    _checked(question, SQUAD_SOURCE, "task", "", realigned))
    return QATask("embedded:squad", splits[False], splits[True],
                  {"embedded": SQUAD_SOURCE.name, "dev_articles": list(SQUAD_DEV_ARTICLES),
                   "answers_realigned": len(realigned)})


EMBEDDED = {"embedded:squad": embedded_squad}


def _report(result: dict) -> list[str]:
    window = result["sliding_window"]
    return [f"{'sliding window':<24}{100 * window['value']:>7.1f}%   (exact match {100 * window['exact_match']:.1f}%: "
            f"the {window['span_words']}-word span whose {window['width']} words each side share the most words "
            f"with the question)"]


register_family(Family(
    "qa", "extractive QA", encode, finetune, lambda pretrained, task, train, dev, *rest: baselines(task, train, dev),
    from_files=lambda args: from_files(args.train, args.validation), sample_train=sample_train, embedded=EMBEDDED,
    detects=is_squad, own_flags=lambda args: ["--stride"] if getattr(args, "stride", None) is not None else [],
    min_steps=600, units="questions",
    head=lambda hp: f"windows sharing {hp['stride'] if hp.get('stride') is not None else hp['max_seq_len'] // 4} tokens",
    train_texts=lambda task: [[text] for text in dict.fromkeys(q.context for q in task.train)],  # each context once
    report_lines=_report,
    no_model_baseline=lambda r: (r["sliding_window"]["value"], "sliding window") if r.get("sliding_window") else None,
    task_type="question-answering"))
