"""Stop strings and stop token ids: where output is cut and what is held back while streaming."""

import pytest

from atom_kv.reference.stopping import StopChecker


def _run(stop, stop_ids, text):
    """Push ``text`` byte by byte; return what was shown after each token and the stop reason."""
    checker = StopChecker(stop, stop_ids)
    shown = []
    for ch in text.encode():
        step = checker.push(ch)
        shown.append(bytes(step.release).decode())
        if step.stopped:
            return shown, step.stop_reason
    shown.append(bytes(checker.flush()).decode())  # ended by length: whatever was held is shown
    return shown, None


@pytest.mark.parametrize("stop,text,expect,reason", [
    (["lo w"], "hello world", "hel", "lo w"),
    (["ab"], "xxaxabyy", "xxax", "ab"),
    (["aab"], "zaaab", "za", "aab"),               # overlapping partial matches
    (["b c", "aab"], "zaaab", "za", "aab"),
    (["x", "yz"], "abyz", "ab", "yz"),
    (["\n"], "line one\nline two", "line one", "\n"),
    (["abc"], "abc", "", "abc"),                   # stops on the first tokens: nothing shown
])
def test_output_is_cut_before_the_stop_string(stop, text, expect, reason):
    shown, why = _run(stop, [], text)
    assert "".join(shown) == expect and why == reason


def test_text_that_may_begin_a_stop_string_is_held_back_then_released():
    shown, why = _run(["lo w"], [], "hello there")
    assert why is None and "".join(shown) == "hello there"
    # "l", "lo", "lo " could begin "lo w": each is shown only once the next byte rules it out
    assert shown[:6] == ["h", "e", "", "l", "", ""]
    assert shown[6] == "lo t"


def test_stop_token_id_ends_the_request_and_is_not_shown():
    shown, why = _run([], [ord("q")], "helloqzz")
    assert "".join(shown) == "hello" and why == ord("q")
    shown, why = _run(["lo"], [ord("q")], "helq")  # held text is shown when a stop token ends it
    assert "".join(shown) == "hel" and why == ord("q")


def test_without_stop_conditions_every_token_is_shown_at_once():
    checker = StopChecker()
    assert not checker.active
    assert [checker.push(t).release for t in b"abc"] == [[97], [98], [99]]
