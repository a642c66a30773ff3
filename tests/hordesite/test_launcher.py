"""The web process's tweaks (thread switch interval, gc.freeze()) are the launcher's: importing the
ASGI application leaves Python's defaults, `scripts/run.py web` applies them before daphne runs."""

from __future__ import annotations

from tests.hordesite.clone import ROOT, clean_env, run_python

SHOW = "import gc, sys; {}; print(sys.getswitchinterval(), gc.get_freeze_count())"


def test_importing_the_application_changes_no_process_setting():
    shown = run_python(ROOT, clean_env(DJANGO_SETTINGS_MODULE="hordesite.settings"), "-c", SHOW.format("import hordesite.asgi"))
    assert shown.returncode == 0, shown.stderr
    interval, frozen = shown.stdout.split()
    assert float(interval) == 0.005 and int(frozen) == 0


def test_the_launcher_sets_them_before_daphne():
    # serve_web with daphne's --help: the tweaks are applied, then daphne's command line exits.
    code = "\n".join(
        [
            "import gc, runpy, sys",
            "serve_web = runpy.run_path('scripts/run.py')['serve_web']",
            "try:",
            "    serve_web(['--help'])",
            "except SystemExit:",
            "    pass",
            "print(sys.getswitchinterval(), gc.get_freeze_count())",
        ]
    )
    shown = run_python(ROOT, clean_env(HORDE_GIL_SWITCH_INTERVAL_MS="2"), "-c", code)
    assert shown.returncode == 0, shown.stderr
    interval, frozen = shown.stdout.split()[-2:]
    assert float(interval) == 0.002 and int(frozen) > 0
