# ctest driver for epmoe-bench's command line (no GPU needed: the flags are checked before any CUDA
# call). Runs BENCH with ARGS (one string, split like a shell would), then checks that the exit code
# is RC and, if REGEX is set, that stdout + stderr match it.
#   cmake -DBENCH=path/to/epmoe-bench "-DARGS=gemm --iters x" -DRC=2 "-DREGEX=--iters" -P cli_check.cmake
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND ${BENCH} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT 120)
if(NOT "${rc}" STREQUAL "${RC}")
  message(FATAL_ERROR "epmoe-bench ${ARGS}: exit code ${rc}, want ${RC}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(DEFINED REGEX AND NOT "${out}${err}" MATCHES "${REGEX}")
  message(FATAL_ERROR "epmoe-bench ${ARGS}: output does not match '${REGEX}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
message(STATUS "epmoe-bench ${ARGS}: exit code ${rc} as expected")
