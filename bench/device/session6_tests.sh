#!/bin/bash
# Every CUDA test case of test_kernels, test_model and test_runtime, and test_cli's gpu cases.
source "$(dirname "$0")/unpack.sh"
cd /tmp
cuda_tests test_kernels test_model test_runtime
timeout 90 $B/test_cli -tc='gpu*' 2>&1 | tail -2 | tee -a $O/tests.log
true
