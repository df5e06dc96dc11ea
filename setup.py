"""Package metadata comes from settings.ini (nbdev's configuration), so there is one source of truth."""
from configparser import ConfigParser
from setuptools import setup, find_packages

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
c = cfg['DEFAULT']
setup(
    name=c['lib_name'], version=c['version'], description=c['description'], author=c['author'],
    license=c['license'], python_requires='>=' + c['min_python'],
    packages=find_packages(include=[c['lib_path'], c['lib_path'] + '.*']),
    install_requires=c['requirements'].split(),
    extras_require={'dev': c['dev_requirements'].split()},
    entry_points={'nbdev': [f"{c['lib_path']}={c['lib_path']}._modidx:d"],
                  'console_scripts': ['composer2=composer2.cli:main']},
    include_package_data=True, zip_safe=False,
)
