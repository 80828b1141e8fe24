# Installation and packaging in one place, referring to targets by name (included last from the
# top-level CMakeLists.txt, after every target exists).
#
# Components:
#   Unspecified  ddprun, ddprun-rdzvd, ddprun-nccl-id (install rules next to their targets) and
#                the examples under share/ddprun/examples
#   worker       libddprun_worker, its headers, CMake package and pkg-config file
#                (worker_env/worker/CMakeLists.txt)
#   service      the systemd unit for ddprun-rdzvd
#   docs         README and docs/*.md under share/doc/ddprun
#
# Packages (scripts/package):
#   .deb   cpack --config <build>/CPackConfig.cmake: one package "ddprun" holding every component
#          above, installed under /usr, stripped, Depends from dpkg-shlibdeps.
#   wheel  packaging/wheel/build_wheel.py: the three binaries with their shared libraries bundled.
include(GNUInstallDirs)

# --- systemd unit -------------------------------------------------------------------------------
# The checked-in unit names /usr/bin/ddprun-rdzvd (the .deb's path, and what `systemd-analyze
# verify` checks); an install under another prefix gets its own bin directory in ExecStart=.
set(DDPRUN_SYSTEMD_UNIT_DIR "lib/systemd/system" CACHE STRING
    "Where the systemd unit is installed, relative to the install prefix")
set(_ddprun_unit_src ${PROJECT_SOURCE_DIR}/packaging/systemd/ddprun-rdzvd.service)
set(_ddprun_unit_out ${PROJECT_BINARY_DIR}/packaging/systemd/ddprun-rdzvd.service)
install(CODE "
  file(READ \"${_ddprun_unit_src}\" _unit)
  string(REPLACE \"ExecStart=/usr/bin/ddprun-rdzvd\"
                 \"ExecStart=\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/ddprun-rdzvd\" _unit \"\${_unit}\")
  file(WRITE \"${_ddprun_unit_out}\" \"\${_unit}\")
" COMPONENT service)
install(FILES ${_ddprun_unit_out} DESTINATION ${DDPRUN_SYSTEMD_UNIT_DIR} COMPONENT service)

# --- documentation ------------------------------------------------------------------------------
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT docs)
file(GLOB _ddprun_docs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/docs/*.md)
install(FILES ${_ddprun_docs} DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT docs)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/img DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT docs)

# --- man pages and shell completions ------------------------------------------------------------
# Generated from the flag tables and installed by launcher/tools/CMakeLists.txt (man pages
# gzipped; zsh functions where the installed zsh looks); tests/package/deb_inside.sh lists the
# expected files in one place (`expect_files`).

# --- .deb through CPack -------------------------------------------------------------------------
set(DDPRUN_PACKAGE_MAINTAINER "ddprun developers <ddprun@localhost>" CACHE STRING
    "Maintainer field of the .deb (name <email>)")
set(CPACK_PACKAGE_NAME ddprun)
set(CPACK_PACKAGE_VENDOR ddprun)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "native launcher for distributed training (a drop-in torchrun)")
set(CPACK_PACKAGE_DESCRIPTION
    "ddprun launches, watches and restarts distributed training workers (torch DDP\n"
    "and native programs) with torchrun's flags and environment. This package holds\n"
    "ddprun, the elastic rendezvous daemon ddprun-rdzvd with its systemd unit,\n"
    "ddprun-nccl-id, and the worker library libddprun_worker with headers, CMake\n"
    "package and pkg-config file.")
string(REPLACE ";" "" CPACK_PACKAGE_DESCRIPTION "${CPACK_PACKAGE_DESCRIPTION}")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_COMPONENTS_ALL Unspecified worker service docs)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_GROUPING ALL_COMPONENTS_IN_ONE)
set(CPACK_DEBIAN_PACKAGE_NAME ddprun)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${DDPRUN_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION utils)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# bin/ddprun loads OpenSSL 3 with dlopen when a feature needs it (etcd TLS, token handshake:
# rendezvous/openssl/), which dpkg-shlibdeps cannot see.
if(DDPRUN_LAZY_OPENSSL)
  set(CPACK_DEBIAN_PACKAGE_DEPENDS "libssl3 | libssl3t64")
endif()
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
# Workers are the user's programs; torch is what most of them need, not what ddprun needs.
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "python3-torch")
# Maintainer scripts (packaging/debian/): what dh_installsystemd does for a unit that installing
# does not enable: stop the daemon on removal, reload systemd, restart a running daemon after an
# upgrade, drop `systemctl enable`'s links on purge; ldconfig through a trigger.
set(_ddprun_debian ${PROJECT_SOURCE_DIR}/packaging/debian)
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${_ddprun_debian}/postinst ${_ddprun_debian}/prerm ${_ddprun_debian}/postrm ${_ddprun_debian}/triggers)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
# The changelog a native package carries (usr/share/doc/ddprun/changelog.gz, Debian policy
# 12.7): one entry for the version being packaged, gzipped without a time stamp. Its date is the
# configure time's, or SOURCE_DATE_EPOCH's where that is set (reproducible builds).
string(TIMESTAMP DDPRUN_CHANGELOG_DATE "%a, %d %b %Y %H:%M:%S +0000" UTC)
configure_file(${_ddprun_debian}/changelog.in ${PROJECT_BINARY_DIR}/packaging/debian/changelog @ONLY)
add_custom_command(
  OUTPUT ${PROJECT_BINARY_DIR}/packaging/debian/changelog.gz
  COMMAND gzip -9nkf ${PROJECT_BINARY_DIR}/packaging/debian/changelog
  DEPENDS ${PROJECT_BINARY_DIR}/packaging/debian/changelog
  VERBATIM)
add_custom_target(ddprun_changelog ALL DEPENDS ${PROJECT_BINARY_DIR}/packaging/debian/changelog.gz)
install(FILES ${PROJECT_BINARY_DIR}/packaging/debian/changelog.gz DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT docs)
install(FILES ${_ddprun_debian}/lintian-overrides DESTINATION ${CMAKE_INSTALL_DATADIR}/lintian/overrides
        RENAME ddprun COMPONENT docs)
include(CPack)
