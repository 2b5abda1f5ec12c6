from pymtrace.cli import main

raise SystemExit(main())
