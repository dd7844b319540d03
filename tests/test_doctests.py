"""The examples in gleak's docstrings run and print what they say: a wrong example is a bug in the documentation.

Every module of the package is imported under its public name (gleak.*, gleak.attacks.*, gleak.defenses.*,
gleak.protocols.*), so that a module added later is checked too."""
import doctest
import importlib
import pkgutil

import pytest

import gleak


def _modules(package: str = "gleak") -> list[str]:
    """The package's modules, its subpackages' too. From a checkout gleak's path also holds the checkout's root
    (where attacks/ and defenses/ sit): a walk would find gleak inside gleak there, so "gleak.gleak" is skipped."""
    names = [package]
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
        if info.name in ("gleak.gleak", "gleak.__main__"):  # importing __main__ runs the command line
            continue
        names += _modules(info.name) if info.ispkg else [info.name]
    return sorted(set(names))


MODULES = _modules()


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder(exclude_empty=True).find(module, name) if t.examples]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_print_what_they_say(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _examples(name):
        runner.run(test, out=lambda text: print(text, end=""))  # a failure's report lands in the captured output
    assert runner.failures == 0, f"{runner.failures} failing docstring example(s) in {name}: see the captured output"


def test_the_examples_are_found():
    """Not vacuous: the modules known to carry examples are seen, with their examples."""
    assert {"gleak.mechanics.metrics", "gleak.mechanics.dp_bound", "gleak.attacks", "gleak.defenses", "gleak.protocols"} <= set(MODULES)
    assert len(sum((t.examples for t in _examples("gleak.mechanics.metrics")), [])) >= 3
    assert len(sum((t.examples for t in _examples("gleak.mechanics.verdicts")), [])) >= 3
    assert len(sum((t.examples for t in _examples("gleak.mechanics.dp_bound")), [])) >= 3
