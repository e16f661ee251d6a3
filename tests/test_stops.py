"""Stop strings over streamed text: output ends right before the earliest stop string however
the text is chunked, and the stop string itself is never emitted."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gateway.stops import StopMatcher


def run(chunks, stops):
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        out.append(m.feed(c))
        if m.stopped:
            break
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.stopped


def expected(text, stops):
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def test_stop_straddling_chunks():
    assert run(["hello wo", "rld. END", "ING more"], ["ENDING"]) == ("hello world. ", True)
    assert run(["ab", "c", "d"], ["bcd"]) == ("a", True)


def test_partial_match_released_when_it_fails():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "      # "ST" might become STOP: held back
    assert m.feed("AR") == "STAR"
    assert not m.stopped


def test_earliest_of_several_stops_wins():
    assert run(["x = 1\n\ndef", " f():"], ["def", "\n\n"]) == ("x = 1", True)


def test_no_stops_passes_through():
    assert run(["a", "b"], []) == ("ab", False)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab€🙂\n", max_size=30),
       stops=st.lists(st.text(alphabet="ab€🙂\n", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_any_chunking_matches_a_search_over_the_whole_text(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = run(chunks, stops)
    assert (out, stopped) == expected(text, stops)
    assert not any(s in out for s in stops)


def test_a_longer_stop_starting_earlier_wins_over_a_shorter_one_already_complete():
    # "a" is complete after the first chunk, but "\naa" (which starts earlier) may still come.
    assert run(["\na", "a"], ["a", "\naa"]) == ("", True)
    assert run(["\na", "b"], ["a", "\naa"]) == ("\n", True)
    # Generation ends while held back: the complete shorter stop is final.
    assert run(["\na"], ["a", "\naa"]) == ("\n", True)
