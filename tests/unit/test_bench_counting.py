"""benchmarks/results.py trim: how every bench system's generated tokens are counted."""

from benchmarks.results import trim

EOS = 2


def test_eos_ends_the_output_and_counts_as_a_token():
    assert trim([5, 6, EOS, 7, EOS], 10, EOS) == [5, 6, EOS]


def test_max_tokens_cuts_before_a_later_eos():
    assert trim([5, 6, 7, EOS], 3, EOS) == [5, 6, 7]


def test_no_eos_keeps_the_row_up_to_max_tokens():
    assert trim([5, 6, 7], 8, EOS) == [5, 6, 7]
    assert trim((5, 6, 7), 2, EOS) == [5, 6]  # any sequence in, a list out
