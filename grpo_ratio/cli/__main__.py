"""`python -m grpo_ratio.cli ...`: the `grpo-ratio` command."""

from . import main


raise SystemExit(main())
