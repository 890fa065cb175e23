"""MLflow's database stores on a server (PostgreSQL, MySQL, SQL Server: `postgresql://`, `mysql+pymysql://`, ...):
which tracking URIs name one, the port its server listens on by default, and whether SQLAlchemy's driver for it
imports. Checked before anything starts (`relax.runner.preflight`'s `tracking`, `relax.runner.endpoints`): MLflow
itself finds a missing driver only when the run is opened, after Ray has started. Light: SQLAlchemy is imported only
by `driver_problem`, and nothing connects here."""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

from relax.config.credentials import without_secrets

# The server engines MLflow opens as a SQLAlchemy store (mlflow.store.db.db_types.DATABASE_ENGINES, sqlite apart:
# a file, checked as one) and the port each server listens on by default, where the URI names none
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}

# the pip package of each DBAPI module SQLAlchemy's dialects import, where its name differs
_PIP_NAMES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
              "pymysql": "pymysql", "pyodbc": "pyodbc", "pymssql": "pymssql", "asyncpg": "asyncpg",
              "pg8000": "pg8000", "mysql": "mysql-connector-python", "MySQLdb._mysql": "mysqlclient"}


def database_engine(uri: str) -> Optional[str]:
    """The engine ("postgresql", "mysql", "mssql") of a tracking `uri` naming a database server, with or without a
    driver (`postgresql+psycopg2://`), else None (sqlite, a file store, an HTTP server, ...)."""
    engine = urlsplit(uri.strip()).scheme.lower().partition("+")[0]
    return engine if engine in DATABASE_PORTS else None


def driver_problem(uri: str, option: str = "tracking.uri") -> Optional[str]:
    """Why SQLAlchemy cannot open the database store `uri` (the value of `option`) on this machine, without
    connecting: its dialect is unknown, or the dialect's driver (DBAPI module) does not import; None where it would,
    or `uri` names no database server. The message hides the URI's user, password and query."""
    if database_engine(uri) is None:
        return None
    from sqlalchemy.engine.url import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    shown, scheme = without_secrets(uri.strip()), urlsplit(uri.strip()).scheme
    try:
        dialect = make_url(uri.strip()).get_dialect()
    except NoSuchModuleError:
        return (f"{option}={shown}: SQLAlchemy has no driver {scheme!r}; name an installed one "
                f"(e.g. {scheme.partition('+')[0]}://... for the default)")
    except (ArgumentError, ValueError) as exc:
        return f"{option}={shown}: not a database URL SQLAlchemy can parse ({exc})"
    load = getattr(dialect, "import_dbapi", None) or dialect.dbapi  # SQLAlchemy 2, 1.4
    try:
        load()
    except ImportError as exc:
        module = getattr(exc, "name", None) or str(exc)
        pip = _PIP_NAMES.get(module, module)
        return (f"{option}={shown}: the {dialect.name} driver {dialect.driver!r} that this URL selects is not "
                f"installed (no module named {module!r}): pip install {pip!r}, or name an installed driver in the URL "
                f"({dialect.name}+<driver>://...)")
    return None
