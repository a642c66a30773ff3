import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"django", "rest_framework", "accounts", "workers", "chat", "oai", "hordesite", "redis", "celery"}


def test_chat_contract_imports_nothing_of_the_project():
    code = (
        "import sys\n"
        "import contract.chat_limits, contract.chat_errors, contract.chat_policy\n"
        "import contract.chat_declaration, contract.chat_shapes, contract.chat_verify\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT, capture_output=True, text=True, check=True
    )
    loaded = set(eval(result.stdout))  # a printed list of module names
    assert not loaded & FORBIDDEN
