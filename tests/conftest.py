import os, sys, tempfile
from pathlib import Path
import pytest

sys.path.insert(0, str(Path(__file__).parent))

@pytest.fixture
def db(tmp_path):
    "A fresh store file for one test."
    return str(tmp_path/'store.db')

@pytest.fixture
def thread_writer(monkeypatch):
    "The writer thread writes (where a test makes the store fail through this process's engine, which a writer process lacks)."
    monkeypatch.setenv('TORCHEMBER_WRITER', 'thread')

@pytest.fixture(autouse=True, scope='session')
def _private_default_store(tmp_path_factory):
    "Never write the user's default store from tests."
    os.environ['TORCHEMBER_DB'] = str(tmp_path_factory.mktemp('default')/'default.db')

from test_postgres import server, new_database, drop_database   # noqa: F401 (server is a fixture)

@pytest.fixture(params=['sqlite', 'postgresql'])
def store(request, tmp_path):
    "A fresh store: a SQLite file, or a new database on the PostgreSQL server of `$TORCHEMBER_PG_URL` (skipped without one)."
    if request.param == 'sqlite':
        yield str(tmp_path/'store.db')
        return
    srv = request.getfixturevalue('server')
    url = new_database(srv)
    yield url
    drop_database(srv, url)
