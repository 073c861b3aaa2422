import sys

from dataflow.trace.tracer import main

sys.exit(main())
