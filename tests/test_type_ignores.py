"""Every ``# type: ignore`` in the package names its error code and says why on its line (pyproject.toml's
mypy settings make mypy refuse one without a code, and one no longer needed; this checks the reason)."""

import pathlib
import re

import atom_kv

_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<rest>.*)$")
_WITH_REASON = re.compile(r"^\[[a-z-]+(, *[a-z-]+)*\]\s+#\s*\S")


def test_every_type_ignore_names_its_code_and_a_reason():
    root = pathlib.Path(atom_kv.__file__).parent
    bare = []
    seen = 0
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = _IGNORE.search(line)
            if m is None:
                continue
            seen += 1
            if not _WITH_REASON.match(m.group("rest").strip()):
                bare.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    assert seen > 0, "no `# type: ignore` found at all: the scan is not looking where the code is"
    assert bare == [], "a `# type: ignore[code]` needs `# why` after it:\n" + "\n".join(bare)
