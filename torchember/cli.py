"The `torchember` command (`torchember report RUN [--db DB] -o report.html`); `main` is written in nbs/06_report.ipynb."
from .report import main

if __name__ == '__main__': main()
