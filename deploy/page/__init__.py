"""The live page of a run: `actx status RUN --serve [PORT]` and `--html FILE`, from the
same status as `actx status` (deploy/status/).

  data.py      what the page shows, as one JSON-able dict built from a `RunStatus`
  document.py  the page's HTML and CSS: one self-contained document (`render_html`)
  script.py    the page's script: fills it from the data, draws the map and the charts
  server.py    the page served (127.0.0.1) or written once
"""
