"""`python -m pfljax.algorithms`: prints README's table of algorithms (paste it
between the `algorithms:begin` / `algorithms:end` markers of README.md)."""

from pfljax.algorithms import readme_table

print(readme_table())
