"""Shakespeare preprocessing: LEAF's ids and TFF's windows, written out by hand."""

import numpy as np
import pytest

from pfljax.data import shakespeare as S


def test_leaf_ids_are_positions_in_leafs_80_letters():
    assert len(S.LEAF_LETTERS) == 80 and len(set(S.LEAF_LETTERS)) == 80
    np.testing.assert_array_equal(S.leaf_ids(["\n a}", "ABCz"]), [[0, 1, 53, 79], [25, 26, 27, 78]])
    np.testing.assert_array_equal(S.leaf_targets(["a", "}"]), [53, 79])
    with pytest.raises(ValueError, match="'#' is not in LEAF's 80-character"):
        S.leaf_ids(["ab#"])


def test_tff_windows_add_bos_eos_pad_and_shift_by_one():
    assert len(S.TFF_CHARS) == 86 and S.TFF_VOCAB_SIZE == 90
    x, y = S.tff_windows(["dh", "é" + "d" * 5], seq_length=4)
    # "dh": bos 88, d 1, h 2, eos 89 -> [88, 1, 2, 89, 0];
    # "éddddd": bos, oov 87, 1 five times, eos -> 8 ids, padded to 10, 2 windows
    np.testing.assert_array_equal(x, [[88, 1, 2, 89], [88, 87, 1, 1], [1, 1, 89, 0]])
    np.testing.assert_array_equal(y, [[1, 2, 89, 0], [87, 1, 1, 1], [1, 89, 0, 0]])
    assert S.tff_windows([])[0].shape == (0, 80)
