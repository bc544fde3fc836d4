"""``harmpi.info()["native"]`` in each case (issue 22 item 6): the module not
built, built but not loaded yet, loaded, refused; the advice fits how harmpi
was installed (a checkout or an installed copy)."""

from __future__ import annotations

import sys
import types

import pytest
from support import REPO  # noqa: E402 (the checkout, one definition)

from harmpi import api, native


@pytest.fixture
def fresh(monkeypatch):
    """native as in a process that has not called load() yet."""
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_status", native.NOT_YET)
    return monkeypatch


def test_not_built_in_a_checkout(fresh):
    fresh.setattr(native, "_module_file", lambda: None)
    text = native.status()
    assert text.startswith("not built: there is no harmpi._C"), text
    assert f"cd {REPO} && {sys.executable} -m pip install -e . --no-build-isolation" in text
    assert "not loaded" not in text


def test_not_built_in_an_installed_copy(fresh, tmp_path):
    site_pkg = tmp_path / "site-packages" / "harmpi"
    site_pkg.mkdir(parents=True)
    assert native.checkout_root(site_pkg) is None  # no setup.py beside it
    fresh.setattr(native, "_module_file", lambda: None)
    fresh.setattr(native, "checkout_root", lambda: None)
    text = native.status()
    assert text.startswith("not built"), text
    assert "-e ." not in text and "--force-reinstall" in text and "--no-build-isolation" in text


def test_checkout_root_is_the_repository():
    assert native.checkout_root() == REPO
    assert native.checkout_root(REPO / "harmpi") == REPO


def test_built_but_not_loaded_yet_reads_the_file_without_loading(fresh, tmp_path):
    fake = tmp_path / "_C.so"
    fake.write_bytes(b"\x7fELF..." + native.VERSION_MARKER + b"9.9.9+cpu\0...")
    fresh.setattr(native, "_module_file", lambda: str(fake))
    text = native.status()
    assert text.startswith("built (against torch 9.9.9+cpu), not loaded yet"), text
    assert native._loaded is None  # status() loaded nothing


def test_refused_module_advice_fits_an_installed_copy(fresh, tmp_path):
    pytest.importorskip("torch")
    other = tmp_path / "_C.so"
    other.write_bytes(b"\x7fELF..." + native.VERSION_MARKER + b"1.0.0\0")
    fresh.setattr(native, "_module_file", lambda: str(other))
    fresh.setattr(native, "checkout_root", lambda: None)
    assert native.load() is None
    text = native.status()
    assert "built against torch 1.0.0" in text and "--force-reinstall" in text, text
    assert "-e ." not in text


def test_loaded(fresh):
    pytest.importorskip("torch")
    if native._module_file() is None:
        pytest.skip("harmpi._C is not built in this environment (make setup builds it)")
    assert native.load() is not None, native.status()
    assert native.status() == "loaded"


def test_info_reports_the_module_status_without_torch_loaded(fresh):
    """info()["native"] for a context the module does not serve is native.status(),
    also when harmpi.native was not imported by anyone yet."""
    ctx = types.SimpleNamespace(config=types.SimpleNamespace(native=True))
    fresh.setattr(native, "_module_file", lambda: None)
    assert api._native_status(ctx).startswith("not built")
    off = types.SimpleNamespace(config=types.SimpleNamespace(native=False))
    assert api._native_status(off).startswith("off (HARMPI_NATIVE=0")
