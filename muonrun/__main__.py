from muonrun.cli import app

app(prog_name="muonrun")
