"""load_tokenizer's tokenizer shared by threads (issue #62): each thread encodes with its own truncation settings,
and the wrapper that gives it that is still the tokenizer (attributes, save_pretrained, pickle)."""

import copy
import pickle
import sys
import threading
from collections.abc import Callable

import pytest

from drgrpo_jax.models.pretrained import load_tokenizer

from support.chat_models import CHATML, save_chat_tokenizer

TEXTS = ["the quick brown fox", "jumps over", "the lazy dog!"]
ROUNDS = 1000  # a shared tokenizer gave a thread the other's settings within 350 rounds in 20 tries of 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A character-level tokenizer (no special tokens added when encoding) with a chat template."""
    path = str(tmp_path_factory.mktemp("tokenizer"))
    save_chat_tokenizer(path)
    return path


@pytest.fixture
def frequent_switches():
    """Threads switch every microsecond instead of every 5 ms, so two threads' calls interleave within a few
    rounds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def run_together(*rounds: Callable[[], None]) -> list[BaseException]:
    """Runs each function ROUNDS times in its own thread, all at once, until all end or one fails; returns the
    failures."""
    failures: list[BaseException] = []
    stop = threading.Event()

    def repeat(one_round: Callable[[], None]) -> None:
        try:
            for _ in range(ROUNDS):
                if stop.is_set():
                    return
                one_round()
        except Exception as failure:  # noqa: BLE001 - a wrong result or "Already borrowed": either fails the test
            failures.append(failure)
            stop.set()

    threads = [threading.Thread(target=repeat, args=(one_round,)) for one_round in rounds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_two_threads_encode_and_decode_with_their_own_settings(folder, frequent_switches):
    """One thread truncates; the other, as the trainer's prompts and its sampling thread's decode, does not. A
    shared HF tokenizer keeps the truncation on the object, so one thread encoded with the other's (or, with
    tokenizers < 0.23.1, raised "Already borrowed")."""
    tokenizer = load_tokenizer(folder, None)
    whole = [list(ids) for ids in tokenizer(TEXTS)["input_ids"]]

    def truncating():
        assert tokenizer(TEXTS, truncation=True, max_length=4)["input_ids"] == [ids[:4] for ids in whole]

    def encoding_and_decoding():
        ids = tokenizer(TEXTS)["input_ids"]
        assert ids == whole
        assert tokenizer.batch_decode(ids) == TEXTS

    assert run_together(truncating, encoding_and_decoding) == []


def test_a_changed_attribute_reaches_every_thread(folder):
    """A thread that already holds its copy sees an attribute set afterwards (tests set `chat_template`)."""
    tokenizer = load_tokenizer(folder, None)
    seen = []
    with_own_copy, changed = threading.Event(), threading.Event()

    def other_thread():
        seen.append(tokenizer.chat_template)
        with_own_copy.set()
        changed.wait(30)
        seen.append(tokenizer.chat_template)

    thread = threading.Thread(target=other_thread)
    thread.start()
    assert with_own_copy.wait(30)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    changed.set()
    thread.join()
    assert seen == [CHATML, "{{ messages[0]['content'] }}"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_it_saves_pickles_and_copies_as_the_loaded_tokenizer(folder, tmp_path):
    """save_pretrained (the trainer exports the tokenizer with the final model), pickle and deepcopy."""
    import transformers

    tokenizer = load_tokenizer(folder, None)
    expected = tokenizer(TEXTS)["input_ids"]
    tokenizer.save_pretrained(str(tmp_path))
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path))(TEXTS)["input_ids"] == expected
    for again in (pickle.loads(pickle.dumps(tokenizer)), copy.deepcopy(tokenizer)):
        assert type(again) is type(tokenizer)
        assert again(TEXTS)["input_ids"] == expected and again.eos_token_id == tokenizer.eos_token_id == 2
    assert len(tokenizer) == len(transformers.AutoTokenizer.from_pretrained(folder))
