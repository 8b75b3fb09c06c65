"""A long-context retrieval task for a base model: many key/value facts with distractors, one question, an exact answer.

A document is a page of staff records grown to a chosen number of tokens: facts "The <attribute> of <First Last> is
<4 digits>." in random order (each person has two attributes: the other one is the closest distractor), each fact
followed by filler sentences. A question asks for one attribute of one person and starts the answer ("Answer: The
desk number of Lena Park is"), so the completion is the number; the reward is 1 for the exact number, 0 otherwise.

Documents and questions are plain text for a base model (Gemma-3-270M): the tokenizer adds its BOS token in front of a
document (as TRL's tokenization of a prompt does), never in front of a question, and a document's tokens are a prefix
of its questions' prompts (:func:`check_prefix`), so a document's state is captured once and each question extends it.

Measured on a CPU (fp32, greedy, held-out documents, 6 answer tokens): Gemma-3-270M answers 79% ± 6% exactly at 400
tokens (52 questions), 73% ± 6% at 1K, 61% ± 6% at 2K (64 each), 59% ± 9% at 4K (32): imperfect from the start, and
falling with length. Sampled at temperature 1 its answers are nearly random digits (0 of 12 exact at 400 tokens),
so the exact reward needs a lower sampling temperature: 85%, 69% and 52% of 48 samples exact at 0.3, 0.5 and 0.7
(400 tokens); the suite samples at 0.5.

Splits are seeded: the training documents of seed ``s`` come from ``1000 + s``, the held-out documents from a seed no
training split uses (:data:`HELD_OUT_SEED`), the same for every run. Importing this module loads no torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST = (
    "Alice Bruno Chen Dana Elif Farid Greta Hiro Ines Jonas Kemal Lena Mateo Nadia Oskar Priya Quinn Rosa Sven Tariq "
    "Uma Viktor Wanda Xavier Yara Zane Amir Bea Cyrus Dmitri Esme Felix Gia Hugo Ivy Jude Kai Luca Mira Nico Omar Pia "
    "Ravi Sana Theo Ugo Vera Wes Yuki Zoe"
).split()
LAST = (
    "Park Novak Silva Berg Costa Meyer Rossi Tanaka Larsen Dubois Kowalski Moreau Petrov Nilsson Romero Fischer Keller "
    "Horvat Ito Lindqvist Marsh Okafor Quist Reyes Sato Vidal Weber Yilmaz Zeller Abbott Brandt Castro Duarte Ekman"
).split()
ATTRIBUTES = (
    "locker number",
    "desk number",
    "badge number",
    "parking space",
    "phone extension",
    "room number",
)
FILLER = (
    "The weather was mild and the office stayed quiet for most of the afternoon.",
    "Deliveries arrive on Tuesdays and are sorted by the front desk before noon.",
    "The cafeteria menu changes every week and usually includes a vegetarian dish.",
    "Cleaning staff visit the building in the evening after most people have left.",
    "The elevators were serviced last month and now run more smoothly than before.",
    "A new printer was installed on the third floor next to the meeting rooms.",
    "Visitors sign in at reception and wear a paper badge during their stay.",
    "The fire drill is held twice a year, usually on a Thursday morning.",
)
HEADER = "Staff records of the Northgate office. Each record gives one number of one person.\n"
HELD_OUT_SEED = 10**6


@dataclass(frozen=True)
class TaskSpec:
    """The shape of a split: document length, facts, questions."""

    doc_tokens: (
        int  # target tokens of a document (BOS included); the document stops at the last fact that fits
    )
    filler: int = 1  # filler sentences after each fact
    attributes: int = 2  # facts per person (the others are the nearest distractors)
    questions_per_doc: int = 8


def question(attribute: str, person: str) -> str:
    """The question and the start of its answer: the completion is the number."""
    return f"Question: What is the {attribute} of {person}?\nAnswer: The {attribute} of {person} is"


def _sentences(
    rng: random.Random, spec: TaskSpec, people: int
) -> tuple[list[str], dict[tuple[str, str], str]]:
    """``people`` people's facts, shuffled, each followed by ``spec.filler`` filler sentences."""
    names = [f"{f} {last}" for f in FIRST for last in LAST]
    chosen = rng.sample(names, min(people, len(names)))
    facts, table = [], {}
    for person in chosen:
        for attribute in rng.sample(ATTRIBUTES, spec.attributes):
            value = str(rng.randrange(1000, 10000))
            table[(attribute, person)] = value
            facts.append(f"The {attribute} of {person} is {value}.")
    rng.shuffle(facts)
    out = []
    for fact in facts:
        out += [fact, *(rng.choice(FILLER) for _ in range(spec.filler))]
    return out, table


def make_document(tokenizer, rng: random.Random, spec: TaskSpec) -> tuple[str, dict[tuple[str, str], str]]:
    """A document of at most ``spec.doc_tokens`` tokens (BOS included) and its facts ``{(attribute, person): value}``
    (only the facts it states)."""
    per_fact = 12 * (
        1 + spec.filler
    )  # a generous guess of tokens per fact and its filler, to draw enough people
    sentences, table = _sentences(rng, spec, spec.doc_tokens // (per_fact * spec.attributes) + 2)
    counts = [len(ids) + 1 for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"]]  # + "\n"
    used = len(tokenizer(HEADER)["input_ids"])
    kept = []
    for sentence, n in zip(sentences, counts, strict=True):
        if used + n > spec.doc_tokens:
            break
        kept.append(sentence)
        used += n
    while kept and len(tokenizer(HEADER + "\n".join(kept) + "\n")["input_ids"]) > spec.doc_tokens:
        kept.pop()  # the sum of the sentences' counts can miss a merge across a line break
    stated = {k: v for k, v in table.items() if f"The {k[0]} of {k[1]} is {v}." in kept}
    return HEADER + "\n".join(kept) + "\n", stated


def make_split(tokenizer, n_docs: int, spec: TaskSpec, seed: int) -> list[dict]:
    """``n_docs`` documents with ``spec.questions_per_doc`` distinct questions each, the rows of one document
    consecutive: ``{"doc", "doc_id", "question", "answer"}``."""
    rng = random.Random(seed)
    rows = []
    for d in range(n_docs):
        doc, table = make_document(tokenizer, rng, spec)
        keys = rng.sample(sorted(table), min(spec.questions_per_doc, len(table)))
        rows += [{"doc": doc, "doc_id": d, "question": question(*k), "answer": table[k]} for k in keys]
    return rows


def answer_of(completion: str) -> str:
    """The first word of a completion, without a trailing full stop."""
    words = completion.split()
    return words[0].rstrip(".") if words else ""


def exact_reward(completions, answer, **kwargs) -> list[float]:
    """1 for the exact number, 0 otherwise (a TRL reward function: the dataset's ``answer`` column)."""
    return [float(answer_of(c) == a) for c, a in zip(completions, answer, strict=True)]


def document_ids(tokenizer, doc: str) -> list[int]:
    """A document's tokens as TRL tokenizes a prompt that starts with it (the BOS token first)."""
    return tokenizer(doc)["input_ids"]


def question_ids(tokenizer, text: str) -> list[int]:
    """A question's tokens, appended to its document's."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_prefix(tokenizer, row: dict) -> None:
    """Raise if the row's prompt does not tokenize as its document's tokens followed by its question's."""
    whole = tokenizer(row["doc"] + row["question"])["input_ids"]
    parts = document_ids(tokenizer, row["doc"]) + question_ids(tokenizer, row["question"])
    if whole != parts:
        raise ValueError(
            "the document's tokens are not a prefix of the prompt's: the state could not be shared"
        )
