"""The public API: __all__ sorted, complete, and every name importable and documented."""

import inspect

import tokenmill


def test_all_is_sorted_and_complete():
    assert tokenmill.__all__ == sorted(tokenmill.__all__)
    public = {n for n in vars(tokenmill) if not n.startswith("_") and
              not inspect.ismodule(getattr(tokenmill, n))}
    assert public | {"__version__"} == set(tokenmill.__all__)


def test_every_public_name_has_a_docstring():
    for name in tokenmill.__all__:
        obj = getattr(tokenmill, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
