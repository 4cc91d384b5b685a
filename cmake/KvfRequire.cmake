# KvfRequire: every piece the build, the tests or the daemons need is looked up
# here, and a missing one stops the configure at once with the Debian package
# that provides it. Nothing required may drop out of the build silently: a
# missing proto file used to surface minutes later as a missing header.
#
# scripts/install-deps.sh installs all of these; the package names below must
# match its list (scripts/fresh-check.sh proves it on a pristine Debian 12 root).
#
#   kvf_require_program(<var> <program> <debian-package>)
#   kvf_require_file(<path> <debian-package>)
#   kvf_require_pkg(<prefix> <pkg-config-module> <debian-package>)
#   kvf_require_python_module(<python> <module> <debian-package>)
include_guard(GLOBAL)

function(kvf_missing what package)
  message(FATAL_ERROR "kvfence: ${what} not found: install the Debian package '${package}' "
                      "(scripts/install-deps.sh installs everything kvfence needs)")
endfunction()

function(kvf_require_program var program package)
  find_program(${var} ${program})
  if(NOT ${var})
    kvf_missing("program '${program}'" ${package})
  endif()
endfunction()

function(kvf_require_file path package)
  if(NOT EXISTS ${path})
    kvf_missing("${path}" ${package})
  endif()
endfunction()

# pkg_check_modules(REQUIRED) only names the pkg-config module; this names the
# package too. The imported target is PkgConfig::<prefix>, as before.
macro(kvf_require_pkg prefix module package)
  pkg_check_modules(${prefix} QUIET IMPORTED_TARGET GLOBAL ${module})
  if(NOT ${prefix}_FOUND)
    kvf_missing("pkg-config module '${module}'" ${package})
  endif()
endmacro()

function(kvf_require_python_module python module package)
  execute_process(COMMAND ${python} -c "import ${module}" RESULT_VARIABLE rc OUTPUT_QUIET
                  ERROR_QUIET)
  if(NOT rc EQUAL 0)
    kvf_missing("Python module '${module}' (for ${python})" ${package})
  endif()
endfunction()
