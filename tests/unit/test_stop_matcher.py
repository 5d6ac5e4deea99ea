from gateway.parsing import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for i, piece in enumerate(pieces):
        text, stop = matcher.feed(piece, final=i == len(pieces) - 1)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    return "".join(out), None


def test_no_stops_passes_text_through_at_once():
    assert StopMatcher([]).feed("hello", final=False) == ("hello", None)


def test_a_stop_inside_one_piece():
    assert StopMatcher(["END"]).feed("abcENDdef", final=False) == ("abc", "END")


def test_a_stop_across_pieces_is_never_emitted():
    assert feed_all(StopMatcher(["STOP"]), ["hello S", "T", "OP world"]) == ("hello ", "STOP")


def test_holds_back_the_last_characters_a_stop_could_start_in():
    matcher = StopMatcher(["abc"])
    assert matcher.feed("xxab", final=False) == ("xx", None)
    assert matcher.feed("z", final=False) == ("a", None)  # len("abc") - 1 characters stay held
    assert matcher.feed("", final=True) == ("bz", None)


def test_the_earliest_of_several_stops_wins():
    assert StopMatcher(["world", "lo"]).feed("hello world", final=False) == ("hel", "lo")


def test_final_flushes_what_was_held():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("text </en", final=False) == ("text", None)
    assert matcher.feed("", final=True) == (" </en", None)


def test_unicode_stops():
    assert feed_all(StopMatcher(["漢字"]), ["héllo 漢", "字 more"]) == ("héllo ", "漢字")
