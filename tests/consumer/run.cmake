# ctest driver: install the built epmoe into a scratch prefix, then configure, build and run the
# consumer project against it with find_package(epmoe).
set(work ${EPMOE_BUILD_DIR}/consumer_check)
file(REMOVE_RECURSE ${work})
macro(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer check failed at: ${ARGN}")
  endif()
endmacro()
step(${CMAKE_COMMAND} --install ${EPMOE_BUILD_DIR} --prefix ${work}/prefix)
step(${CMAKE_COMMAND} -S ${EPMOE_SOURCE_DIR}/tests/consumer -B ${work}/build -G Ninja
     -DCMAKE_PREFIX_PATH=${work}/prefix)
step(${CMAKE_COMMAND} --build ${work}/build)
step(${work}/build/consumer)
