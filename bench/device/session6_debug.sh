#!/bin/bash
# Session 6: the GPU trainer-graph test and the launched-pipeline CLI test, with full logs in $OUT.
source "$(dirname "$0")/unpack.sh"
cd /tmp
timeout 200 $B/test_model -tc='cuda*' > $O/test_model.log 2>&1; tail -n 3 $O/test_model.log
grep -B3 -A14 "ERROR\|FAILED\|error:" $O/test_model.log | head -40
timeout 120 $B/test_cli -tc='gpu*' > $O/test_cli.log 2>&1; tail -n 3 $O/test_cli.log
grep -v "^step\|^ *[0-9]" $O/test_cli.log | head -60
true
