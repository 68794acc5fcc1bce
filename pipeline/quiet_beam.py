"""Apache Beam's first import in a process, made quietly. Every module of actx that uses
Beam imports this one before `apache_beam`.

Without google-apitools (installed only with Beam's gcp extra, which `actx-lm[pipeline]`
does not need) `import apache_beam` logs "apitools not found, and bigquery client
libraries are not available ..." on the root logger, which also installs a handler there
and so changes every later log line's format. Importing `actx.pipeline` itself imports no
Beam: the pre-flight `actx submit` runs (`pipeline.preflight`) answers without it.
"""

import logging as _logging


class _NoApitoolsNotice(_logging.Filter):
    def filter(self, record: _logging.LogRecord) -> bool:
        return not record.getMessage().startswith("apitools not found")


def _import_beam_quietly() -> None:
    root = _logging.getLogger()
    # A handler keeps logging.warning from configuring the root logger; the filter drops
    # the notice itself. Both go again once Beam is imported.
    handler, notice = _logging.NullHandler(), _NoApitoolsNotice()
    root.addHandler(handler)
    root.addFilter(notice)
    try:
        import apache_beam  # noqa: F401
    except ImportError:  # actx-lm[pipeline] is not installed: the importing module says so
        pass
    finally:
        root.removeHandler(handler)
        root.removeFilter(notice)


_import_beam_quietly()
