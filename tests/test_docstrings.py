"""Every public name of ringtrain, ringtrain.torch, ringtrain.tensorflow and ringtrain.keras is documented: the API
reference (docs/reference/) is generated from these docstrings, so a name without one is a blank entry there.

Functions and classes need a docstring of their own. A public value that is not callable (an op such as `Average`,
`global_process_set`, the `bfloat16` dtype) is documented by its type's docstring or by the module's docstring
naming it.
"""
import importlib
import inspect

import pytest

MODULES = ["ringtrain", "ringtrain.torch", "ringtrain.tensorflow", "ringtrain.keras"]


def public_names(module):
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    return [n for n in names if not inspect.ismodule(getattr(module, n))]


def own_docstring(obj):
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return bool(doc and doc.strip())


def undocumented(module):
    missing = []
    for name in public_names(module):
        obj = getattr(module, name)
        if inspect.isclass(obj) or callable(obj):
            if not own_docstring(obj):
                missing.append(name)
        elif not (own_docstring(type(obj)) or name in (module.__doc__ or "")):
            missing.append(name)
    return missing


def imported(module_name):
    if module_name != "ringtrain" and module_name != "ringtrain.torch":
        pytest.importorskip("tensorflow", reason="tensorflow is missing: the [tensorflow] extra is not installed")
    return importlib.import_module(module_name)


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_name_has_a_docstring(module_name):
    module = imported(module_name)
    assert len(public_names(module)) > 20
    missing = undocumented(module)
    assert not missing, f"{module_name}: public names without a docstring: {missing}"


def test_the_check_catches_a_missing_docstring():
    import types
    module = types.ModuleType("example", "A module that names `documented_constant`.")
    module.documented = lambda: None
    module.documented.__doc__ = "Has one."
    module.bare = lambda: None

    class Documented:
        """Has one."""

    class Inherits(Documented):
        pass

    class Bare:
        pass
    module.documented_constant = Bare()                  # named in the module's docstring
    module.typed_constant = Documented()                 # its type says what it is
    module.bare_constant = Bare()
    module.Documented, module.Inherits = Documented, Inherits
    assert sorted(undocumented(module)) == ["Inherits", "bare", "bare_constant"]


def unannotated(module):
    """Public functions with neither a return annotation nor any parameter annotation."""
    bare = []
    for name in public_names(module):
        obj = getattr(module, name)
        if not inspect.isfunction(obj):
            continue
        signature = inspect.signature(obj)
        if signature.return_annotation is inspect.Signature.empty and all(
                p.annotation is inspect.Parameter.empty for p in signature.parameters.values()):
            bare.append(name)
    return bare


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_function_has_type_hints(module_name):
    module = imported(module_name)
    bare = unannotated(module)
    assert not bare, f"{module_name}: public functions without any type hints: {bare}"


def test_the_check_catches_a_function_without_hints():
    import types
    module = types.ModuleType("example")

    def returns_hinted() -> None:
        """Has one."""

    def parameter_hinted(x: int, y=0):
        """Has one."""

    def bare(x, y=0):
        """Has none."""
    module.returns_hinted, module.parameter_hinted, module.bare = returns_hinted, parameter_hinted, bare
    module.not_a_function = 3
    assert unannotated(module) == ["bare"]
