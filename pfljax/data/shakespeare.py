"""Shakespeare next-character preprocessing, as LEAF and TFF do it.

LEAF (TalwalkarLab/leaf, models/utils/language_utils.py): an 80-character
vocabulary `LEAF_LETTERS` (its ALL_LETTERS; id = position, `word_to_indices` /
`letter_to_vec`); each sample is an 80-character string x and the one next
character y: one label per sequence (`leaf_ids`, `leaf_targets`).

TFF (tff.simulation.baselines.shakespeare.char_prediction_preprocessing, the
text-generation tutorial's vocabulary `TFF_CHARS`, 86 characters): ids 1..86 for
the characters, 0 padding (`pfljax.core.losses.PAD_ID`), 87 out-of-vocabulary, 88
beginning and 89 end of snippet (vocabulary of 90); each variable-length snippet
becomes bos + ids + eos, padded to a multiple of 81 and cut into 81-id windows,
x = window[:-1] and y = window[1:]: sequence-to-sequence targets [80] with the
padding masked by the "token_cross_entropy" loss (`tff_windows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pfljax.core.losses import PAD_ID

SEQ_LENGTH = 80  # McMahan et al. (AISTATS 2017), LEAF and TFF
# LEAF's ALL_LETTERS (leaf/models/utils/language_utils.py): 80 characters.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
# TFF's CHAR_VOCAB (tff.simulation.baselines.shakespeare, from the text-generation tutorial).
TFF_CHARS = "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r"
TFF_OOV, TFF_BOS, TFF_EOS = len(TFF_CHARS) + 1, len(TFF_CHARS) + 2, len(TFF_CHARS) + 3
TFF_VOCAB_SIZE = len(TFF_CHARS) + 4
_LEAF_TABLE = np.full(256, -1, np.int32)  # LEAF id of each byte value (-1: none)
_LEAF_TABLE[[ord(ch) for ch in LEAF_LETTERS]] = np.arange(len(LEAF_LETTERS))


def leaf_ids(strings: Sequence[str]) -> np.ndarray:
    """[n, len] int32 LEAF ids of equal-length strings (LEAF's word_to_indices; a
    character outside the vocabulary is -1 there and a ValueError here)."""
    codes = np.array([[ord(ch) for ch in s] for s in strings], np.int64).reshape(len(strings), -1)
    ids = np.where(codes < 256, _LEAF_TABLE[np.minimum(codes, 255)], -1)
    if (ids < 0).any():
        bad = chr(int(codes[ids < 0][0]))
        raise ValueError(f"character {bad!r} is not in LEAF's 80-character Shakespeare vocabulary")
    return ids.astype(np.int32)


def leaf_targets(chars: Sequence[str]) -> np.ndarray:
    """[n] int32 LEAF ids of the next characters (LEAF's letter_to_vec, as an index)."""
    return leaf_ids([c[:1] for c in chars]).reshape(len(chars))


def tff_ids(snippet: str) -> np.ndarray:
    """[len + 2] int32 TFF ids: bos, each character (oov outside TFF_CHARS), eos."""
    ids = [TFF_CHARS.find(ch) + 1 or TFF_OOV for ch in snippet]  # find: -1 outside
    return np.array([TFF_BOS, *ids, TFF_EOS], np.int32)


def tff_windows(snippets: Sequence[str], seq_length: int = SEQ_LENGTH) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) int32 [k, seq_length]: every snippet's ids padded (PAD_ID) to a multiple
    of seq_length + 1 and cut into windows; x = window[:-1], y = window[1:]."""
    windows = []
    for snippet in snippets:
        ids = tff_ids(snippet)
        padded = np.full(-(-len(ids) // (seq_length + 1)) * (seq_length + 1), PAD_ID, np.int32)
        padded[: len(ids)] = ids
        windows.append(padded.reshape(-1, seq_length + 1))
    w = np.concatenate(windows) if windows else np.zeros((0, seq_length + 1), np.int32)
    return w[:, :-1], w[:, 1:]
