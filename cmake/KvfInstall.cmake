# What `cmake --install` installs besides libkvfence (clients/c) and the CLI
# (clients/cli), and the Debian package (`cpack -G DEB`). Paths follow
# GNUInstallDirs, which on Debian with CMAKE_INSTALL_PREFIX=/usr gives the
# distribution's layout (libdir lib/x86_64-linux-gnu):
#   sbin/     kvfence-control, kvfence-node: daemons the administrator or the
#             system starts (Debian puts daemons in /usr/sbin)
#   bin/      kvfence, the admin CLI
#   libdir/   libkvfence.so*, pkgconfig/kvfence.pc, cmake/kvfence/
#   include/  kvfence/kvfence.h
#   lib/python3/dist-packages/kvfence/   the Python package, stubs included
#             (KVF_INSTALL_PYTHONDIR; Debian's python3 reads this directory
#             under /usr only: with /usr/local use lib/python3.11/dist-packages)
#   share/doc/kvfence/   README.md and docs/*.md (api.md is the API reference)
# tests/install/expected-files.txt lists the tree and install_check checks it.
include(GNUInstallDirs)

set(KVF_INSTALL_PYTHONDIR "lib/python3/dist-packages" CACHE STRING
    "where the kvfence Python package is installed, relative to the prefix")

# The daemons link only static kvfence libraries and system ones, plus CUDA's
# runtime from outside the system paths when built with CUDA: they keep that
# path (the link path) in the build and once installed, and are not rewritten
# at install time.
set_target_properties(kvfence-control kvfence-node PROPERTIES BUILD_WITH_INSTALL_RPATH ON
                                                              INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS kvfence-control kvfence-node RUNTIME DESTINATION ${CMAKE_INSTALL_SBINDIR})

# The package: its sources, then the stubs python_client generated (the
# build tree's kvfence/_proto, with their .pyi type stubs). One directory
# once installed; py.typed marks it typed (PEP 561).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/clients/python/kvfence/
        DESTINATION ${KVF_INSTALL_PYTHONDIR}/kvfence
        FILES_MATCHING PATTERN "*.py" PATTERN "py.typed" PATTERN "__pycache__" EXCLUDE)
install(DIRECTORY ${PROJECT_BINARY_DIR}/clients/python/kvfence/_proto
        DESTINATION ${KVF_INSTALL_PYTHONDIR}/kvfence
        FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "__pycache__" EXCLUDE)

install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
foreach(doc api cli control-plane design engines logging metrics node quickstart security state-cores)
  install(FILES ${PROJECT_SOURCE_DIR}/docs/${doc}.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
endforeach()

# ---- the Debian package: `cpack -G DEB` in the build directory (configure
# with -DCMAKE_INSTALL_PREFIX=/usr for Debian's multiarch libdir). One package,
# kvfence, with everything above; its shared-library dependencies come from
# dpkg-shlibdeps, the Python package's from the list below.
set(KVF_DEB_MAINTAINER "kvfence developers <noreply@kvfence.invalid>" CACHE STRING
    "Maintainer field of the .deb (set it for a release)")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME kvfence)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "KV-cache page ownership for disaggregated LLM serving")
set(CPACK_PACKAGE_DESCRIPTION
    "kvfence-control (the control plane), kvfence-node (the data-plane daemon), the kvfence admin CLI, the C client library (libkvfence) and the Python package. Pages are given back only on a proof that nothing can touch them any more.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${KVF_DEB_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "https://github.com/kvfence/kvfence")
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "python3, python3-grpcio, python3-protobuf")
include(CPack)
