"""The border reader (mamba3lite/intake.py): every class of bad file is one error of the kind's class,
naming the file, and nothing blocks or reads without bound."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from mamba3lite import intake as I
from mamba3lite.errors import CheckpointError, ConfigError, DataError, DataNotFoundError

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")


def _file(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return p


BAD_JSON = {
    "syntax": ("{", "line 1"),
    "huge-int": ('{"a": ' + "9" * 5000 + "}", "5,000 digits"),
    "deep": ("[" * 100_000, "nested too deeply"),
    "nan": ('{"a": NaN}', "NaN is not a finite number"),
    "infinity": ('{"a": -Infinity}', "-Infinity"),
    "overflowing-float": ('{"a": 1e400}', "too large"),
    "not-utf8": (b'{"a": "\xff"}', "not a UTF-8 text file"),
    "wrong-top-type": ("[1, 2]", "must be an object"),
    "empty": ("", "Expecting value"),
}


@pytest.mark.parametrize("name", sorted(BAD_JSON))
def test_every_kind_of_bad_json_is_one_error_naming_the_file(tmp_path, name):
    content, expected = BAD_JSON[name]
    p = _file(tmp_path, "manifest.json", content)
    with pytest.raises(DataError) as info:
        I.read_json(p, I.MANIFEST)
    message = str(info.value)
    assert str(p) in message and expected in message and "re-run `mamba3lite prepare`" in message


def test_good_json_and_the_error_class_follow_the_kind(tmp_path):
    p = _file(tmp_path, "x.json", '{"a": [1, 2.5, "s", null], "b": ' + "9" * I.MAX_INT_DIGITS + "}")
    assert I.read_json(p, I.MANIFEST)["a"] == [1, 2.5, "s", None]
    with pytest.raises(CheckpointError):
        I.read_json(_file(tmp_path, "m.json", "[1]"), I.META)
    with pytest.raises(ConfigError):
        I.read_json(_file(tmp_path, "t.json", "{"), I.TOKENIZER)
    # Our own checkpoint writer may store a non-finite metric: the meta kind reads it back.
    assert I.read_json(_file(tmp_path, "n.json", '{"v": NaN}'), I.META)["v"] != 0


def test_a_missing_file_raises_the_kinds_not_found_class(tmp_path):
    with pytest.raises(DataNotFoundError, match="does not exist"):
        I.read_json(tmp_path / "nope.json", I.MANIFEST)
    with pytest.raises(CheckpointError, match="does not exist"):
        I.read_json(tmp_path / "nope.json", I.META)


def test_directories_devices_and_links_to_devices_are_not_regular_files(tmp_path):
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    for path, what in (
        (tmp_path, "a directory"),
        (link, "a character device"),
        (Path("/dev/null"), "device"),
    ):
        with pytest.raises(DataError, match="must be a regular file") as info:
            I.read_json(path, I.MANIFEST)
        assert what in str(info.value)


@needs_fifo
def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    error = _error_without_blocking(lambda: I.read_yaml(fifo, I.CONFIG))
    assert isinstance(error, ConfigError) and "named pipe" in str(error)


def _error_without_blocking(fn) -> BaseException | None:
    """What `fn()` raised, run in a thread that must end within 10 s (None if it raised nothing)."""
    result: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # the test inspects it
            result.append(e)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    return result[0] if result else None


def test_the_size_cap_refuses_before_reading(tmp_path):
    small = I.FileKind("thing", 10, DataError, "fix it")
    p = _file(tmp_path, "big.json", "[" + "1," * 20 + "1]")
    with pytest.raises(DataError, match="more than a thing can be"):
        I.read_json(p, small, top=None)
    assert I.read_prefix(p, small, 4) == b"[1,1"


BAD_YAML = {
    "syntax": ("model: [1, 2\n", "not valid YAML"),
    "huge-int": ("model:\n  d_model: " + "9" * 5000 + "\n", "integer too long"),
    "deep": ("a: " + "[" * 100_000, "nested too deeply"),
    "duplicate-key": ("a: 1\na: 2\n", "a"),
    "not-utf8": (b"a: \xff\n", "not a UTF-8 text file"),
}


@pytest.mark.parametrize("name", sorted(BAD_YAML))
def test_every_kind_of_bad_yaml_is_one_config_error(tmp_path, name):
    content, expected = BAD_YAML[name]
    p = _file(tmp_path, "c.yaml", content)
    with pytest.raises(ConfigError) as info:
        I.read_yaml(p, I.CONFIG)
    assert str(p) in str(info.value) and expected in str(info.value)


def test_jsonl_lines_carry_their_problem_instead_of_raising(tmp_path):
    p = _file(
        tmp_path,
        "metrics.jsonl",
        b'{"step": 1}\n\n{"step": '
        + b"9" * 5000
        + b'}\n{"step": NaN}\n\xff\xfe\n'
        + b"[" * 50_000
        + b"\n{tor",
    )
    lines = list(I.iter_jsonl(p, I.METRICS))
    assert lines[0].value == {"step": 1} and lines[0].problem is None
    problems = [ln.problem for ln in lines[1:]]
    assert len(problems) == 5 and all(problems)
    assert "digits" in problems[0] and "NaN" in problems[1] and "UTF-8" in problems[2]
    assert "nested too deeply" in problems[3] and "line 6" in problems[3] and "line 7" in problems[4]


def test_a_jsonl_line_beyond_the_line_cap_is_one_bad_line(tmp_path, monkeypatch):
    monkeypatch.setattr(I, "MAX_JSONL_LINE_BYTES", 64)
    p = _file(tmp_path, "m.jsonl", '{"step": 1}\n' + '{"x": "' + "a" * 500 + '"}\n{"step": 2}\n')
    lines = list(I.iter_jsonl(p, I.METRICS))
    assert [ln.value for ln in lines if ln.problem is None] == [{"step": 1}, {"step": 2}]
    assert sum(ln.problem is not None for ln in lines) == 1


def test_expect_checks_fields_and_names_the_bad_one():
    row = {"step": 3, "loss": 2.5, "kind": "train", "extra": object()}
    schema = {"step": int, "loss": float, "kind": str}
    assert I.expect(row, schema, where="m", kind=I.METRICS) is row
    for bad, what in (
        ({**row, "step": True}, "step must be an integer"),
        ({**row, "loss": None}, "loss must be a number"),
        ({**row, "loss": float("inf")}, "loss must be a number"),
        ({k: v for k, v in row.items() if k != "kind"}, "kind is missing"),
        ([row], "must be an object"),
    ):
        with pytest.raises(DataError, match=what):
            I.expect(bad, schema, where="m", kind=I.METRICS)
    assert I.expect(
        {"step": 1}, {"step": int, "loss": (float, type(None))}, where="m", kind=I.METRICS, optional=("loss",)
    )


def test_numbers_from_yaml_strings_as_the_flags_read_them():
    assert I.as_number("5e-1", where="w") == 0.5 and I.as_number("1e6", where="w") == 1e6
    assert I.as_number(3, where="w") == 3.0
    assert I.as_count("1e6", where="w") == 1_000_000 and I.as_count("20_000_000", where="w") == 20_000_000
    for bad, what in (
        (True, "number"),
        ("fast", "number"),
        ("nan", "finite"),
        (10**400, "too large"),
        (None, "number"),
    ):
        with pytest.raises(ConfigError, match=what):
            I.as_number(bad, where="w")
    with pytest.raises(ConfigError, match="whole number"):
        I.as_count("2.5", where="w")
    with pytest.raises(ConfigError, match=">= 1"):
        I.as_count(0, where="w", minimum=1)


# --------------------------------------------------------------------------- line readers: iter_lines


def _gz(tmp_path: Path, name: str, lines: list[bytes]) -> Path:
    import gzip

    p = tmp_path / name
    p.write_bytes(gzip.compress(b"".join(lines)))
    return p


def test_lines_are_numbered_blank_ones_skipped_and_a_gz_file_read_through(tmp_path):
    plain = _file(tmp_path, "a.jsonl", b'{"n": 1}\n\n{"n": 2}')  # the last line without its newline
    zipped = _gz(tmp_path, "a.jsonl.gz", [b'{"n": 1}\n', b"\n", b'{"n": 2}'])
    for p in (plain, zipped):
        assert list(I.iter_lines(p, I.SOURCE_JSONL, max_line_bytes=64)) == [
            (1, b'{"n": 1}\n'),
            (3, b'{"n": 2}'),
        ]
        assert [ln.value for ln in I.iter_jsonl(p, I.METRICS)] == [{"n": 1}, {"n": 2}]


def test_a_line_beyond_the_cap_comes_as_none_and_is_never_read_whole(tmp_path):
    p = _file(tmp_path, "a.jsonl", b"x" * 1000 + b"\nshort\n")
    assert list(I.iter_lines(p, I.SOURCE_JSONL, max_line_bytes=100)) == [(1, None), (2, b"short\n")]


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "not-gzip"])
def test_a_damaged_gz_is_one_error_naming_the_file(tmp_path, damage):
    import gzip

    good = gzip.compress(b"".join(b'{"text": "%d"}\n' % i for i in range(5000)))
    data = {
        "truncated": good[: len(good) // 2],  # a download cut short
        "corrupt": good[:40] + bytes(b ^ 0xFF for b in good[40:100]) + good[100:],
        "not-gzip": b"plain text, named .gz\n",
    }[damage]
    p = _file(tmp_path, "d.jsonl.gz", data)
    with pytest.raises(DataError) as info:
        list(I.iter_lines(p, I.SOURCE_JSONL, max_line_bytes=1 << 20))
    message = str(info.value)
    assert message.startswith(f"cannot read {p}") and "\n" not in message and I.SOURCE_JSONL.fix in message


def test_a_gz_that_inflates_past_the_kinds_cap_is_refused(tmp_path):
    p = _gz(tmp_path, "bomb.jsonl.gz", [b'{"a": 1}\n' * 10_000])  # 90 KB inflated from a few hundred bytes
    no_newline = _gz(tmp_path, "line.jsonl.gz", [b"x" * 100_000])  # one line past the line cap, skipped
    small = I.FileKind("thing", 1000, DataError, "fix it")
    for bomb in (p, no_newline):
        lines = I.iter_lines(bomb, small, max_line_bytes=100)
        with pytest.raises(DataError, match=r"holds more than .* a thing can be; fix it"):
            list(lines)


@needs_fifo
def test_a_named_pipe_named_jsonl_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    error = _error_without_blocking(lambda: list(I.iter_lines(fifo, I.SOURCE_JSONL, max_line_bytes=64)))
    assert isinstance(error, DataError) and "named pipe" in str(error)


def test_json_problem_follows_the_kinds_number_rules():
    long_int = '{"n": ' + "9" * 200 + "}"
    assert I.json_problem(long_int, I.SOURCE_JSONL) == ({"n": int("9" * 200)}, None)  # a document may
    assert "200 digits" in I.json_problem(long_int, I.METRICS)[1]  # a record of ours may not
    assert I.json_problem('{"x": NaN}', I.SOURCE_JSONL)[1] is None
    assert "NaN" in I.json_problem('{"x": NaN}', I.MANIFEST)[1]
    assert "Exceeds the limit" in I.json_problem("9" * 5000, I.SOURCE_JSONL)[1]  # Python's own limit
    assert I.json_problem("[" * 100_000, I.SOURCE_JSONL) == (None, "nested too deeply")
    assert I.json_problem("null", I.MANIFEST) == (None, None)  # valid JSON whose value is None


def test_a_source_jsonl_reads_through_the_border(tmp_path):
    """prepare's .jsonl sources: a pipe is refused, a torn .gz is one error, a non-UTF-8 line is still a
    document (its bytes are replaced and counted by the cleaner), a long integer in a field is fine."""
    from mamba3lite.data import sources as S

    p = _file(tmp_path, "d.jsonl", b'{"text": "caf\xe9", "id": ' + b"7" * 150 + b'}\n{"text": "b"\n')
    units = list(S.Source(str(p)).units())
    assert [S.parse_jsonl_line(payload, "text")[0] for _, _, payload in units] == ["caf\udce9", None]
    assert "malformed JSON" in S.parse_jsonl_line(units[1][2], "text")[1]
    whole = _gz(tmp_path, "x.gz", [b'{"text": "%d"}\n' % i for i in range(3000)]).read_bytes()
    torn = _file(tmp_path, "t.jsonl.gz", whole[: len(whole) // 2])
    with pytest.raises(DataError, match=rf"^cannot read {torn}"):
        list(S.Source(str(torn)).units())
